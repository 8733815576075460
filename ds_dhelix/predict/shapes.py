"""What the predictor knows of a model and a run: the op lists of its blocks (``ModelOutline``,
made by ``hf_models.outline`` from the engine's own graph builder), the sizes its op costs need
(``ModelShape``, read from a Hugging Face config) and the run's layout (``RunLayout``).

Plain data: ``model_shape`` reads a config's attributes and imports nothing of transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.dims import ParallelDims

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
NON_GATED = ("gpt2", "gpt_neox")
"""Families whose MLP is one up projection and an activation (no gate)."""


@dataclass(frozen=True)
class OpLine:
    """One op of a block as the predictor sees it: name, COMM or not, linear on the way to its
    weights (its weight gradient may be deferred); ``members``: a fused run's ops (``fuse_ops``:
    the COMP ops between two collectives run as one op), () for an op of its own."""

    name: str
    comm: bool
    linear: bool = False
    members: tuple[OpLine, ...] = ()


def op_names(ops) -> set[str]:
    """The names of ``ops`` (``OpLine``), a fused run's members' in its place."""
    return {name for op in ops for name in (op_names(op.members) if op.members else (op.name,))}


@dataclass(frozen=True)
class ModelOutline:
    """The blocks ``[pre, layer 0 .. layer L-1, post]`` of the op graph the engine would build for
    this layout, each layer's sliding window (None: full attention), and whether its COMP ops
    between two collectives are fused runs (``fuse_ops``)."""

    blocks: tuple[tuple[OpLine, ...], ...]
    windows: tuple[int | None, ...]
    fused: bool = False

    def __post_init__(self):
        if len(self.windows) != len(self.blocks) - 2:
            raise ValueError(f"outline: {len(self.blocks) - 2} layers but {len(self.windows)} windows")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that its op costs depend on (a dense or MoE decoder)."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's width
    vocab: int
    gated: bool = True  # MLP with a gate projection (SwiGLU-like)
    tied: bool = False  # LM head shares the embedding
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts together
    shared_gate: bool = False  # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)
    q_lora_rank: int = 0  # multi-head latent attention (DeepSeek-V3): 0 = none
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    learned_positions: bool = False  # GPT-2's position embedding

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Width of one query/key head in the attention scores."""
        return self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim


def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _moe_fields(config) -> dict:
    experts = int(_first(config, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)
    if not experts:
        return {}
    inter = int(_first(config, "moe_intermediate_size", "intermediate_size"))
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    shared += int(getattr(config, "n_shared_experts", 0) or 0) * inter
    return {
        "experts": experts,
        "top_k": int(config.num_experts_per_tok),
        "expert_intermediate": inter,
        "shared_intermediate": shared,
        "shared_gate": bool(getattr(config, "shared_expert_intermediate_size", 0)),
    }


def _mla_fields(config) -> dict:
    if not getattr(config, "kv_lora_rank", None):
        return {}
    return {
        "q_lora_rank": int(getattr(config, "q_lora_rank", None) or 0),
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_rope_dim": int(config.qk_rope_head_dim),
        "qk_nope_dim": int(config.qk_nope_head_dim),
        "v_head_dim": int(config.v_head_dim),
    }


def model_shape(config) -> ModelShape:
    """The ``ModelShape`` of a Hugging Face config (any family the adapters run)."""
    hidden = int(_first(config, "hidden_size", "n_embd"))
    heads = int(_first(config, "num_attention_heads", "n_head"))
    inter = _first(config, "intermediate_size", "n_inner") or 4 * hidden
    return ModelShape(
        model_type=config.model_type,
        num_layers=int(_first(config, "num_hidden_layers", "n_layer")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate=int(inter),
        vocab=int(config.vocab_size),
        gated=config.model_type not in NON_GATED,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        learned_positions=config.model_type == "gpt2",
        **_moe_fields(config),
        **_mla_fields(config),
    )


@dataclass(frozen=True)
class RunLayout:
    """A run's parallel layout and shapes: ``dims`` (world, TP, PP, EP, CP), the micro-batch
    (``micro_batch_size`` sequences of ``seq_len`` tokens), ``micro_batches`` per optimizer step on
    each data-parallel group, the dtype of activations and weights, and the ZeRO stage."""

    dims: ParallelDims
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    dtype: str = "bf16"
    zero_stage: int = 0
    overlap_grad_reduction: bool = True  # the data-parallel reduction during the last backward (one stage)

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        for name in ("seq_len", "micro_batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero_stage}: ds_dhelix runs ZeRO 0, 1, 2 or 3")
        if self.zero_stage == 3 and self.dims.pp > 1:
            raise ValueError("zero stage 3 with a pipeline: ds_dhelix does not run it yet")
        self.dims.check_seq_len(self.seq_len, "--seq-len")

    @property
    def bytes(self) -> int:
        """Bytes of one activation / weight element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over the whole world."""
        return self.micro_batches * self.micro_batch_size * self.seq_len * self.dims.dp

    def with_micro_batch(self, size: int) -> RunLayout:
        """The same run with ``size`` sequences per micro-batch (intra's halves)."""
        return dataclasses.replace(self, micro_batch_size=size)
