"""The DeepSpeed settings ds_dhelix reads, parsed once beside ``DhelixConfig``.

    ds = DeepSpeedSettings.from_ds_config(ds_config)   (check_setup builds it; Setup.ds carries it)

Every check before the model is built, and the engine builder after it, reads this view instead of
the raw dict. Parsed by DeepSpeed's own config models where they read what we read:

- ``zero_optimization``: ``DeepSpeedZeroConfig`` (stage, the offload devices, ``reduce_bucket_size``,
  the ZeRO++ keys, the stage-3 save gather), after our own check of the stage (one line naming the
  values, where pydantic's would be a table);
- ``bf16`` / ``fp16`` and the loss scaler: ``DeepSpeedBF16Config`` / ``DeepSpeedFP16Config`` (so the
  old ``"bfloat16"`` spelling counts as DeepSpeed counts it);
- gradient clipping and the optimizer / scheduler types: DeepSpeed's ``get_gradient_clipping`` /
  ``get_optimizer_name`` / ``get_scheduler_name``.

By hand, where DeepSpeed's models do not say it:

- which keys a section sets as written (the models fill defaults, drop ``"auto"`` values and rename
  aliases; a message names the user's key and value, and some checks turn on "given or not");
- which ``activation_checkpointing`` keys are on (DeepSpeed's reader fills every key);
- ``data_types.grad_accum_dtype`` as written (DeepSpeed maps it to a torch dtype only inside the
  engine);
- that the sections are JSON objects (before DeepSpeed's models see them);
- the batch triple: ``section.derive_batch`` fills it as DeepSpeed does, but counts the
  data-parallel size over DP x CP from the dhelix section, which DeepSpeed does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SECTIONS = ("fp16", "bf16", "zero_optimization", "activation_checkpointing", "scheduler", "optimizer")
"""Top-level keys that must be JSON objects."""

ZEROPP_KEYS = {
    "zero_hpz_partition_size": "ZeRO++'s secondary partitions",
    "zero_quantized_weights": "ZeRO++'s quantized gathers",
    "zero_quantized_nontrainable_weights": "ZeRO++'s quantized gathers",
    "zero_quantized_gradients": "ZeRO++'s quantized reduce-scatters",
}
"""ZeRO++ keys (on: a secondary partition size above 1, a quantization flag true)."""

_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def zero_stage_of(section: Any) -> int:
    """``zero_optimization.stage`` (0 when absent); ``ValueError`` unless it is 0, 1, 2 or 3."""
    stage = (section or {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage = {stage!r}: use 0, 1, 2 or 3")
    return stage


@dataclass(frozen=True)
class ZeroSettings:
    """``zero_optimization``, as DeepSpeed parses it, and the keys it sets as written."""

    stage: int = 0
    # the section's keys and values as the ds_config writes them
    written: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    offload_optimizer: str = "none"  # the device ("none", "cpu", "nvme")
    offload_param: str = "none"
    reduce_bucket_size: int | None = None  # None: left to DeepSpeed's default (or to ours)
    zeropp_on: tuple[str, ...] = ()  # the ZeRO++ keys that are on (ZEROPP_KEYS)

    @classmethod
    def parse(cls, section: Any) -> ZeroSettings:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        stage = zero_stage_of(section)
        written = dict(section or {})
        model = _parsed(DeepSpeedZeroConfig, written, "zero_optimization")
        on = [k for k in ZEROPP_KEYS if k in written and _zeropp_on(k, getattr(model, k))]
        return cls(
            stage=stage,
            written=MappingProxyType(written),
            offload_optimizer=_device(model.offload_optimizer),
            offload_param=_device(model.offload_param),
            reduce_bucket_size=int(model.reduce_bucket_size) if "reduce_bucket_size" in written else None,
            zeropp_on=tuple(on),
        )


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The DeepSpeed settings ds_dhelix's checks and builder read (see the module docstring)."""

    keys: tuple[str, ...] = ()  # the top-level keys, in the order written
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    bf16: bool = False
    fp16: bool = False
    loss_scale: float = 0.0  # fp16: 0 is the dynamic scaler
    initial_scale_power: int = 16
    gradient_clipping: float = 0.0
    optimizer: str | None = None  # the "optimizer" section's type; None: no section (or no type)
    optimizer_params: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # its "params" as written
    has_optimizer: bool = False
    scheduler: str | None = None
    checkpointing_on: tuple[str, ...] = ()  # activation_checkpointing keys set to a true value
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype as written
    micro_batch_size: int | None = None  # train_micro_batch_size_per_gpu as written

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> DeepSpeedSettings:
        """Parse once; ``ValueError`` naming the key for a section that is not a JSON object, a ZeRO
        stage other than 0-3, or a value DeepSpeed's own models refuse."""
        from deepspeed.runtime import config as ds
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

        for key in SECTIONS:
            if key in ds_config and not isinstance(ds_config[key], dict):
                raise ValueError(f'"{key}" must be a JSON object (e.g. {{"enabled": true}}), got {ds_config[key]!r}')
        zero = ZeroSettings.parse(ds_config.get("zero_optimization"))
        bf16 = _parsed(DeepSpeedBF16Config, _bf16_section(ds_config), "bf16")
        fp16 = _parsed(DeepSpeedFP16Config, dict(ds_config.get("fp16") or {}), "fp16")
        checkpointing = ds_config.get("activation_checkpointing") or {}
        accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
        micro = ds_config.get("train_micro_batch_size_per_gpu")
        return cls(
            keys=tuple(ds_config),
            zero=zero,
            bf16=bool(bf16.enabled),
            fp16=bool(fp16.enabled),
            loss_scale=float(fp16.loss_scale),
            initial_scale_power=int(fp16.initial_scale_power),
            gradient_clipping=_clipping(ds.get_gradient_clipping(ds_config)),
            optimizer=ds.get_optimizer_name(ds_config) if "optimizer" in ds_config else None,
            has_optimizer="optimizer" in ds_config,
            optimizer_params=MappingProxyType(dict((ds_config.get("optimizer") or {}).get("params") or {})),
            scheduler=ds.get_scheduler_name(ds_config) if "scheduler" in ds_config else None,
            checkpointing_on=tuple(sorted(k for k, v in checkpointing.items() if v)),
            grad_accum_dtype=None if accum is None else str(accum),
            micro_batch_size=micro if isinstance(micro, int) and not isinstance(micro, bool) else None,
        )

    def optimizer_is(self, name: str) -> bool:
        """Whether the "optimizer" section's type is ``name`` (DeepSpeed matches its own names in any case)."""
        return (self.optimizer or "").lower() == name.lower()

    @property
    def half(self) -> str | None:
        """``"bf16"`` / ``"fp16"`` when one is enabled, else None (fp32)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    @property
    def grad_accum_matches(self) -> bool:
        """Whether ``data_types.grad_accum_dtype`` is absent or the training dtype."""
        if self.grad_accum_dtype is None:
            return True
        name = _DTYPE_NAMES.get(self.grad_accum_dtype.lower(), self.grad_accum_dtype)
        return name == (self.half or "fp32")


def _bf16_section(ds_config: dict) -> dict:
    section = ds_config.get("bf16", ds_config.get("bfloat16"))
    return dict(section) if isinstance(section, dict) else {}


def _parsed(model_class, section: dict, name: str):
    """``model_class(**section)``; pydantic's refusal as one line naming the key and the reason."""
    from pydantic import ValidationError

    try:
        return model_class(**section)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        key = f"{name}.{where}" if where else name
        raise ValueError(
            f"{key}: {first.get('msg')} (DeepSpeed's config refuses it); fix it as DeepSpeed's config docs say"
        ) from None


def _clipping(value) -> float:
    """``gradient_clipping`` (0: none); HF's ``"auto"`` is left to the Trainer, which fills it."""
    if value in (None, "auto"):
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"gradient_clipping must be a number >= 0 (0: no clipping), got {value!r}")
    return float(value)


def _device(offload) -> str:
    if offload is None:
        return "none"
    device = offload.device
    return str(getattr(device, "value", device))


def _zeropp_on(key: str, value) -> bool:
    if key == "zero_hpz_partition_size":
        return int(value) > 1
    return bool(value)
