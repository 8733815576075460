"""What one parity run compares (``ParityOptions``: model, layout, steps, precision, stochastic
settings, LoRA) and the model every leg starts from (``build``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = ("fp32", "bf16", "fp16")

OPTIMIZERS = {
    "AdamW": {"weight_decay": 0.01, "torch_adam": True},
    "Adam": {"weight_decay": 0.01, "torch_adam": True, "adam_w_mode": False},  # torch.optim.Adam (L2 decay)
    "SGD": {"momentum": 0.9},  # a torch.optim name: DeepSpeed builds it (zero_allow_untested_optimizer)
    "Muon": {"weight_decay": 0.01},  # DeepSpeed's MuonWithAuxAdam: Muon on matrices, Adam on the rest
    "Lion": {"weight_decay": 0.01},  # DeepSpeedCPULion under offload_optimizer cpu, FusedLion on CUDA
}
"""The optimizer types a parity run can train with: the "optimizer" section's params beside lr (the
HF reference builds the same optimizer: ``reference_optimizer``)."""


@dataclass
class ParityOptions:
    model: str = "tiny-llama"
    tp: int = 2
    dp: int = 1
    schedule: str = "si"
    steps: int = 3
    micro_batches: int = 4
    micro_batch_size: int = 2
    seq_len: int = 64
    zero_stage: int = 1
    zero: dict = field(default_factory=dict)  # more zero_optimization keys (stage3_param_persistence_threshold, ...)
    lr: float = 1e-3
    seed: int = 1234
    num_layers: int | None = None  # shrink the preset (faster tests)
    extra: dict = field(default_factory=dict)  # extra "dhelix" keys
    pp: int = 1  # pipeline stages: > 1 compares the folded pipeline against PP=1 sequential
    clip: float = 1.0  # gradient_clipping
    dtype: str = "fp32"  # "fp32", "bf16" or "fp16" (DeepSpeed's mixed precision; HF compared in fp32 only)
    dropout: float = 0.0  # every dropout rate of the model (HF is then compared with it off, as with the model's own)
    recompute: str = "none"  # dhelix.recompute of the trained legs
    packing: str = "concat"  # "docs": random documents of random lengths (position_ids, block-diagonal mask)
    cp: int = 1  # context-parallel size
    cp_comm: str = "ulysses"  # its exchange: "ulysses" or "ring"
    lora: dict = field(default_factory=dict)  # LoraConfig keys: every leg trains that PEFT LoRA model
    optimizer: str = "AdamW"  # a key of OPTIMIZERS
    resume_at: int = 0  # > 0: the schedule's leg stops after this step with a checkpoint a new engine resumes
    export: bool = False  # the schedule's leg exports (HF checkpoint / PEFT adapter), reloaded and probed

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp * self.cp

    @property
    def ep(self) -> int:
        return int(self.extra.get("expert_parallel", {}).get("size", 1))

    def precision_config(self) -> dict:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.dtype == "bf16":
            return {"bf16": {"enabled": True}}
        if self.dtype == "fp16":
            return {"fp16": {"enabled": True, "initial_scale_power": 16}}
        return {}

    def optimizer_config(self) -> dict:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        section = {"optimizer": {"type": self.optimizer, "params": {"lr": self.lr, **OPTIMIZERS[self.optimizer]}}}
        if self.optimizer == "SGD":
            section["zero_allow_untested_optimizer"] = True
        return section

    def ds_config(self, schedule: str) -> dict:
        return {
            **self.precision_config(),
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": self.clip,
            "steps_per_print": 10**9,
            **self.optimizer_config(),
            "zero_optimization": {"stage": self.zero_stage, **self.zero},
            "dhelix": {
                "enabled": True,
                "schedule": schedule,
                "tensor_parallel": {"size": self.tp},
                "seed": self.seed,
                **({"pipeline": {"stages": self.pp}} if self.pp > 1 else {}),
                **({"context_parallel": {"size": self.cp, "comm": self.cp_comm}} if self.cp > 1 else {}),
                **({"recompute": self.recompute} if self.recompute != "none" else {}),
                **self.extra,
            },
        }


def check_options(opts: ParityOptions, config=None):
    """``ValueError`` before any rank starts: the layout against the model (its first
    ``num_layers`` layers when set; ``config``: that config, read already), the schedule, the
    pipeline, the sequence and the packing — the project's own checks (``check_setup``). Returns
    the ``Setup``."""
    from hf_models.adapters import check_packing
    from hf_models.registry import load_config, with_num_layers

    from ..engine.build import check_setup

    if opts.pp > 1 and opts.schedule == "si":
        raise ValueError("--pp > 1 runs a folded schedule: pass --schedule w, dualpipev or sequential")
    if opts.pp == 1 and opts.schedule in ("w", "dualpipev"):
        raise ValueError(f"--schedule {opts.schedule} folds the model over pipeline ranks: pass --pp 2 or more")
    if opts.dtype == "fp16":  # as the ranks do: a CPU accelerator without fp16 is told to run it (slowly)
        from ..engine.precision import force_fp16_capability

        force_fp16_capability()
    if config is None:
        config = load_config(opts.model)
        if opts.num_layers is not None:
            config = with_num_layers(config, opts.num_layers)
    setup = check_setup(opts.ds_config(opts.schedule), config, opts.world)
    setup.dims.check_seq_len(opts.seq_len, "--seq-len")
    check_packing(config, opts.packing)
    return setup


def trained_stochastic(opts: ParityOptions) -> dict[str, float]:
    """The stochastic settings the trained legs run with, ``{config key: value}`` of those on: the
    model's own (its config's dropout rates, router jitter / noise) with ``opts.dropout`` over
    every dropout rate."""
    from hf_models.adapters import dropout_overrides, stochastic_settings
    from hf_models.registry import load_config

    config = load_config(opts.model)
    settings = stochastic_settings(config)
    if opts.dropout:
        settings.update(dropout_overrides(config, opts.dropout))
    return settings


def build(opts: ParityOptions, stochastic: bool = True):
    """The model every leg starts from (same seed, same layers; ``opts.dropout``: every dropout
    rate set to it); ``stochastic=False``: every stochastic setting off, the model's own included
    (the HF comparison's legs: ``trained_stochastic`` set to 0)."""
    from hf_models.adapters import dropout_overrides
    from hf_models.registry import build_model, load_config

    overrides = dropout_overrides(load_config(opts.model), opts.dropout) if opts.dropout else {}
    if not stochastic:
        overrides = {**overrides, **{key: 0.0 for key in trained_stochastic(opts)}}
    model = build_model(opts.model, seed=opts.seed, num_layers=opts.num_layers, overrides=overrides or None)[0]
    return with_lora(model, opts.lora, opts.seed) if opts.lora else model


def with_lora(model, lora: dict, seed: int):
    """``model`` as a PEFT LoRA model of ``lora`` (LoraConfig keys); the factors are drawn from
    ``seed`` (B too, unless ``init_lora_weights`` is given: a zero B would hide the adapter's
    forward from the comparisons)."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        return get_peft_model(model, LoraConfig(**{"init_lora_weights": False, **lora}))


def my_share(opts: ParityOptions, step: list[dict], dp_rank: int) -> list[dict]:
    m = opts.micro_batches
    return step[dp_rank * m : (dp_rank + 1) * m]


def moe_kernels(opts: ParityOptions) -> str:
    """The legs' ``dhelix.moe.kernels``."""
    return opts.extra.get("moe", {}).get("kernels", "torch")


def with_moe_kernels(opts: ParityOptions, kernels: str) -> ParityOptions:
    from dataclasses import replace

    return replace(opts, extra={**opts.extra, "moe": {**opts.extra.get("moe", {}), "kernels": kernels}})


def intra_has_halves_reference(opts: ParityOptions) -> bool:
    """Whether ``intra`` is bitwise a sequential run over half-size micro-batches here: even rows,
    and every row with as many targets (no packed documents' ignored boundaries)."""
    return opts.micro_batch_size % 2 == 0 and opts.packing == "concat"


def halved(opts: ParityOptions) -> ParityOptions:
    from dataclasses import replace

    return replace(opts, micro_batch_size=opts.micro_batch_size // 2, micro_batches=2 * opts.micro_batches)
