"""Parity: train the same model with ``sequential`` and another schedule on a CPU gloo world, and
the unsharded HF model on one process; compare.

Sequential and SI run the same ops in a different interleaving, so losses and parameters after
every step must agree bit for bit. The sharded model differs from HF only in summation order (TP
partial sums, the sum-then-divide loss, DP averaging), so it is compared where that shows as
rounding: the first step's gradients (before clipping and the optimizer) and every step's loss.
Parameters after a few AdamW steps are not compared with HF: Adam divides by sqrt(v), so for a
weight whose gradient is ~0 a rounding-level gradient difference moves its update by a sizeable
part of the learning rate.

Stochastic settings (dropout rates, MoE router jitter / noise; ``adapters.stochastic_settings``),
from ``--dropout`` or the model's own config (a checkpoint trained with dropout or router jitter):
the trained legs keep them (SI and sequential draw the same seeded masks, so they stay
bitwise), while HF draws from its own generator, so it is compared on the first step only, with
every one of them off on both sides (``hf_stochastic_off`` in the result names them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# fp32 CPU. Gradients: TP splits each row-parallel GEMM into partial sums added by a
# reduce-scatter, so a gradient entry differs from HF's by rounding of sums of ~100-1000 terms of
# size <= |g|max: well below 1e-5 x max |g| (which is O(1) for these losses). Losses: the same
# rounding through a few steps of training; a real bug moves them by far more than 1e-5.
HF_GRAD_TOLERANCE = 1e-5  # max |grad diff| at step 1, relative to max |HF grad| (at least 1)
HF_LOSS_TOLERANCE = 1e-5
DTYPES = ("fp32", "bf16", "fp16")

# tutel's kernels (``dhelix.moe.kernels``) write the same rows and weigh the copies in float32 as
# torch's do, so the first-step loss is the same; their backward sums each routing weight's
# gradient over the hidden size in tutel's own order, which moves the router's gradients (and what
# flows back from them) by rounding of a sum of ``hidden`` terms: held within 1e-6 x max |g|.
KERNELS_GRAD_TOLERANCE = 1e-6
# HF's MoE blocks are dropless: with a capacity factor that drops copies the model differs from
# HF's by design, so only SI = sequential (and the kernels' agreement) can hold then.
CAPACITY_NOTE = ("capacity mode: Hugging Face's model is dropless, so hf_close holds only when no copy is "
                 "dropped (a capacity factor large enough for the busiest expert)")

# The intra schedule sums each weight gradient as two halves' sums (and each loss as two halves'),
# so it is not bitwise equal to sequential: its first-step gradients and every step's loss are held
# to sequential's within the HF tolerances above in fp32 (the same kind of rounding: one more
# split of a sum). In bf16 / fp16 the halves' partial sums are rounded to 8 / 11 bits of mantissa
# before they are added, and a few optimizer steps carry that on: the losses are held within
# INTRA_LOSS_TOLERANCE_LOW_PRECISION (a wrong half weighting moves them by ~the loss itself).
INTRA_LOSS_TOLERANCE_LOW_PRECISION = 2e-2


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

    def ds_config(self, schedule: str) -> dict:
        return {
            **self.precision_config(),
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": self.clip,
            "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": self.zero_stage},
            "dhelix": {"enabled": True, "schedule": schedule, "tensor_parallel": {"size": self.tp}, "seed": self.seed,
                       **({"pipeline": {"stages": self.pp}} if self.pp > 1 else {}),
                       **({"context_parallel": {"size": self.cp, "comm": self.cp_comm}} if self.cp > 1 else {}),
                       **({"recompute": self.recompute} if self.recompute != "none" else {}), **self.extra},
        }


EOS_ID = 2  # the presets' EOS token: random ids are drawn from 3 on, so only placed ones end documents


def make_batches(opts: ParityOptions, vocab: int) -> list[list[dict]]:
    """``[step][dp_rank * m + k]`` micro-batches of random token ids (deterministic); with
    ``packing="docs"`` each row holds documents of random lengths (an EOS ends each), with their
    ``position_ids`` and -100 targets across document boundaries."""
    from ..data import document_positions
    g = torch.Generator().manual_seed(opts.seed + 1)
    out = []
    for _ in range(opts.steps):
        step = []
        for _ in range(opts.dp * opts.micro_batches):
            ids = torch.randint(3, vocab, (opts.micro_batch_size, opts.seq_len), generator=g)
            if opts.packing == "docs":
                ends = torch.rand(ids.shape, generator=g) < 4.0 / opts.seq_len  # ~4 documents a row
                step.append({"input_ids": ids.masked_fill(ends, EOS_ID),
                             **document_positions(ids.masked_fill(ends, EOS_ID), EOS_ID)})
            else:
                step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    return out


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


def _my_share(opts: ParityOptions, step: list[dict], dp_rank: int) -> list[dict]:
    m = opts.micro_batches
    return step[dp_rank * m:(dp_rank + 1) * m]


def _train(opts: ParityOptions, schedule: str, batches, gather) -> dict:
    """Build the engine for ``schedule`` and train on this rank's share of every step; ``gather``
    (engine -> full parameters or None) runs before the engine is destroyed."""
    from .build import build_engine
    engine = build_engine(build(opts), opts.ds_config(schedule))
    losses, peaks = [], []
    for step in batches:
        losses.append(float(engine.train_batch(iter(_my_share(opts, step, engine.groups.dp_rank)))))
        peaks.append(engine.last_stats.peak_activation_bytes)
    params = gather(engine)
    engine.destroy()
    return {"losses": losses, "params": params, "peak_activation_bytes": max(peaks), "rank": engine.groups.rank}


def train_schedule(opts: ParityOptions, schedule: str, batches) -> dict:
    """On every rank of the world: train with ``schedule``; return losses, full params, peak."""
    from .checkpoint import full_state_dict
    return _train(opts, schedule, batches,
                  lambda engine: full_state_dict(engine.module, engine.groups.tp_grad_group, engine.groups.tp_size))


def first_step(opts: ParityOptions, batches, schedule: str = "sequential") -> dict:
    """On every rank: the sharded model's first step (``schedule``, every stochastic setting off,
    before clipping and the optimizer) through the build path's sharding and the executor alone:
    its full gradients and its loss (mean over the micro-batches, TP and CP shares summed, DP averaged)."""
    import torch.distributed as dist

    from .build import check_setup, shard_model
    from .checkpoint import full_grads
    from ..runtime.executor import Executor
    from ..runtime.groups import ProcessGroups
    from hf_models.adapters import unwrap_peft
    model, _ = unwrap_peft(build(opts, stochastic=False))
    setup = check_setup(opts.ds_config("sequential"), model.config, dist.get_world_size())
    groups = ProcessGroups.create(setup.dims)
    graph = shard_model(model, setup.dh, setup.dims, groups)
    mine = _my_share(opts, batches[0], groups.dp_rank)
    mbs = Executor(graph).run_microbatches(mine, schedule, 1.0 / len(mine))
    loss = torch.stack([mb.loss.detach().float() for mb in mbs]).mean()
    for group, size in ((groups.tp_grad_group, groups.tp_size), (groups.cp_group, groups.cp_size),
                        (groups.dp_group, groups.dp_size)):
        if size > 1:
            dist.all_reduce(loss, group=group)
    return {"grads": full_grads(model, groups), "loss": float(loss) / groups.dp_size}


def train_hf(opts: ParityOptions, batches) -> dict:
    """The unsharded HF model, one process, same data and optimizer, every stochastic setting off
    (``build(stochastic=False)``); also its first-step gradients."""
    from ..data import hf_model_inputs
    from hf_models.common import hf_mask_windows
    from hf_models.lora import our_name
    model = build(opts, stochastic=False)
    windows = hf_mask_windows(model.config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.01)
    losses, grads = [], None
    for step in batches:
        total = 0.0
        for b in step:
            loss = model(**hf_model_inputs(b, windows=windows)).loss / len(step)
            loss.backward()
            total += float(loss.detach())
        if grads is None:
            grads = {our_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if opts.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], opts.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "grads": grads}


def _rank_main(rank, world, opts: ParityOptions):
    from hf_models.registry import load_config
    note = _result_note(opts)
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    seq = train_schedule(opts, "sequential", batches)
    other = train_schedule(opts, opts.schedule, batches) if opts.schedule != "sequential" else seq
    halves = None
    if opts.schedule == "intra":
        if opts.dtype == "fp32":
            other["first_step"] = first_step(opts, batches, "intra")
        if intra_has_halves_reference(opts):
            halves = train_schedule(halved(opts), "sequential", halve_batches(batches))
    torch_kernels = None
    if opts.dtype == "fp32":
        seq["first_step"] = first_step(opts, batches)
        if moe_kernels(opts) != "torch":  # the same first step on torch's dispatch / combine kernels
            torch_kernels = first_step(with_moe_kernels(opts, "torch"), batches)
    if rank != 0:
        return None
    hf = train_hf(opts, batches) if opts.dtype == "fp32" and not _hf_cannot_take_the_mask(opts) else None
    out = compare(opts, seq, other, hf, note=note)
    if torch_kernels is not None:
        compare_kernels(out, seq["first_step"], torch_kernels, moe_kernels(opts))
    return judge_halves(out, other, halves) if opts.schedule == "intra" else out


def moe_kernels(opts: ParityOptions) -> str:
    """The legs' ``dhelix.moe.kernels``."""
    return opts.extra.get("moe", {}).get("kernels", "torch")


def with_moe_kernels(opts: ParityOptions, kernels: str) -> ParityOptions:
    from dataclasses import replace
    return replace(opts, extra={**opts.extra, "moe": {**opts.extra.get("moe", {}), "kernels": kernels}})


def compare_kernels(out: dict, first: dict, reference: dict, kernels: str) -> None:
    """``out["vs_torch_kernels"]``: the first step on ``kernels`` against the same step on torch's
    kernels (loss bitwise or not, gradients within ``KERNELS_GRAD_TOLERANCE``); ``ok`` requires it."""
    scale = max(1.0, max(float(g.abs().max()) for g in reference["grads"].values()))
    grad_diff = max_diff(first["grads"], reference["grads"])
    bitwise = all(torch.equal(first["grads"][k], reference["grads"][k]) for k in reference["grads"])
    close = grad_diff <= KERNELS_GRAD_TOLERANCE * scale and abs(first["loss"] - reference["loss"]) <= HF_LOSS_TOLERANCE
    out["vs_torch_kernels"] = {"kernels": kernels, "first_step_loss": first["loss"],
                               "torch_first_step_loss": reference["loss"],
                               "loss_bitwise_equal": first["loss"] == reference["loss"],
                               "grads_bitwise_equal": bitwise, "max_first_step_grad_diff": grad_diff,
                               "grad_tolerance": KERNELS_GRAD_TOLERANCE * scale, "close": close}
    out["ok"] = out["ok"] and close


def judge_halves(out: dict, intra: dict, halves: dict | None) -> dict:
    """``intra`` against sequential over half-size micro-batches (``halves``: that run, or None
    where there is none): bitwise required; where nothing else held intra to anything (MoE balance
    loss, dropout or router noise in bf16/fp16) and there is no such run, the result is not judged
    and not ok."""
    if halves is not None:
        out["bitwise_equal_to_half_microbatches"] = all(torch.equal(halves["params"][k], intra["params"][k])
                                                        for k in intra["params"])
        out["losses"]["sequential-halves"] = halves["losses"]
        out["ok"] = out["ok"] and out["bitwise_equal_to_half_microbatches"]
    elif out.pop("intra_needs_halves", False):
        out["ok"] = False
        out["intra_tolerance"] += ("; NOT JUDGED: no half-size reference here (it needs an even --micro-batch-size "
                                   "and --packing concat)")
    out.pop("intra_needs_halves", None)
    return out


def intra_has_halves_reference(opts: ParityOptions) -> bool:
    """Whether ``intra`` is bitwise a sequential run over half-size micro-batches here: even rows,
    and every row with as many targets (no packed documents' ignored boundaries)."""
    return opts.micro_batch_size % 2 == 0 and opts.packing == "concat"


def halved(opts: ParityOptions) -> ParityOptions:
    from dataclasses import replace
    return replace(opts, micro_batch_size=opts.micro_batch_size // 2, micro_batches=2 * opts.micro_batches)


def halve_batches(batches):
    """``make_batches``' steps with every micro-batch cut into its two halves, in order."""
    from ..runtime.interpreter import half_batches
    out = []
    for step in batches:
        out.append([{k: v for k, v in half.items() if k not in ("loss_denominator", "loss_share")}
                    for b in step for half in half_batches(b)])
    return out


def _hf_cannot_take_the_mask(opts: ParityOptions) -> bool:
    """Packed documents on an MoE model: HF's load-balancing loss cannot take a 4-D mask."""
    from hf_models.registry import load_config
    from hf_models.adapters import num_experts
    return opts.packing == "docs" and num_experts(load_config(opts.model)) > 0


def _result_note(opts: ParityOptions) -> str:
    """fp16 on a CPU without DeepSpeed's fp16 support: override the capability check (torch computes
    fp16 on CPU) and say so in the result. Capacity mode: say why HF may differ."""
    notes = []
    if opts.extra.get("expert_parallel", {}).get("capacity_factor") is not None:
        notes.append(CAPACITY_NOTE)
    if opts.dtype == "fp16":
        from .precision import force_fp16_capability
        notes.append(force_fp16_capability())
    return "; ".join(notes)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def compare(opts, seq, other, hf, label: str | None = None, note: str = "") -> dict:
    """``seq`` (sequential, with its ``first_step``) against ``other`` (bitwise) and ``hf``
    (within tolerances; None: not compared, e.g. under bf16/fp16). ``label``: the key of ``other``
    in "losses" / "peak_activation_bytes" (default: the schedule)."""
    label = label or opts.schedule
    bitwise = seq["losses"] == other["losses"] and all(
        torch.equal(seq["params"][k], other["params"][k]) for k in seq["params"])
    out = {
        "options": {k: v for k, v in asdict(opts).items() if k != "extra"},
        "bitwise_equal": bitwise,
        "max_abs_diff_vs_sequential": max_diff(other["params"], seq["params"]),
        "losses": {"sequential": seq["losses"], label: other["losses"]},
        "peak_activation_bytes": {"sequential": seq["peak_activation_bytes"],
                                  label: other["peak_activation_bytes"]},
        "note": note,
    }
    if hf is None:
        why = (f"dtype {opts.dtype} (the HF reference runs fp32)" if opts.dtype != "fp32" else
               "packed documents with MoE layers (HF's load-balancing loss cannot take a 4-D attention mask)")
        out.update(hf_comparison=f"skipped: {why}", hf_close=None, hf_stochastic_off=None,
                   max_abs_diff_vs_hf=None, max_loss_diff_vs_hf=None, ok=bitwise)
        if label == "intra":
            _judge_intra(opts, out, seq, other, None)
        return out
    first = seq["first_step"]
    grad_diff = max_diff(hf["grads"], first["grads"])  # HF's trained parameters (a LoRA model's factors)
    grad_scale = max(1.0, max(float(g.abs().max()) for g in hf["grads"].values()))
    stochastic = trained_stochastic(opts)
    if stochastic:  # the trained legs draw masks / noise HF does not: only the first step, with all of it off
        loss_diff, what = abs(first["loss"] - hf["losses"][0]), (
            f"first-step gradients (before clipping) and loss, with {stochastic_kinds(opts, stochastic)} off "
            f"({describe_settings(stochastic)} in the trained legs)")
    else:
        loss_diff = max(abs(a - b) for a, b in zip(other["losses"], hf["losses"]))
        what = "first-step gradients (before clipping) and every step's loss"
    if opts.packing == "docs":
        what += "; HF given the packed documents' position_ids and block-diagonal causal mask"
    close = grad_diff <= HF_GRAD_TOLERANCE * grad_scale and loss_diff <= HF_LOSS_TOLERANCE
    out["losses"]["hf"] = hf["losses"]
    out.update(max_abs_diff_vs_hf=grad_diff, max_loss_diff_vs_hf=loss_diff, hf_comparison=what,
               hf_grad_tolerance=HF_GRAD_TOLERANCE * grad_scale, hf_loss_tolerance=HF_LOSS_TOLERANCE,
               hf_close=close, hf_stochastic_off=stochastic, ok=bitwise and close)
    if label == "intra":
        _judge_intra(opts, out, seq, other, grad_scale)
    return out


def describe_settings(settings: dict[str, float]) -> str:
    """``{"resid_pdrop": 0.1, ...}`` -> ``"resid_pdrop 0.1, ..."``."""
    return ", ".join(f"{key} {value:g}" for key, value in settings.items())


def stochastic_kinds(opts: ParityOptions, settings: dict[str, float]) -> str:
    """What ``settings`` (config keys of ``opts.model``) are, in words: "dropout", "router noise"
    or "dropout and router noise"."""
    from hf_models.adapters import adapter_for
    from hf_models.registry import load_config
    dropout_keys = adapter_for(load_config(opts.model)).DROPOUT_KEYS
    kinds = [kind for kind, keys in (("dropout", [k for k in settings if k in dropout_keys]),
                                     ("router noise", [k for k in settings if k not in dropout_keys])) if keys]
    return " and ".join(kinds)


def _judge_intra(opts: ParityOptions, out: dict, seq: dict, intra: dict, grad_scale: float | None) -> None:
    """``intra`` is held to sequential within tolerances (see INTRA_LOSS_TOLERANCE_LOW_PRECISION's
    comment), not bitwise; the HF comparison (fp32) still has to pass. Where the math differs
    from sequential's on purpose it is held to the half-size micro-batches' run only (the caller
    adds that): with dropout or router noise (other draws: the losses are not compared, the first
    step runs without them) and with an MoE balance loss (each half's own)."""
    from hf_models.adapters import num_experts
    from hf_models.moe_family import default_aux_loss_coef
    from hf_models.registry import load_config
    config = load_config(opts.model)
    coef = opts.extra.get("expert_parallel", {}).get("aux_loss_coef")
    aux = num_experts(config) > 0 and (default_aux_loss_coef(config) if coef is None else coef) > 0
    loss_diff = max(abs(a - b) for a, b in zip(seq["losses"], intra["losses"]))
    out["max_loss_diff_vs_sequential"] = loss_diff
    stochastic = trained_stochastic(opts)
    if aux:
        out["intra_tolerance"] = ("not compared with sequential: each half's own load-balancing loss (held to the "
                                  "half-size micro-batches' run)")
        out["ok"], out["intra_needs_halves"] = True, True
        if out.get("hf_close") is not None:
            out["hf_close"] = None
            out["hf_comparison"] = "skipped: HF's load-balancing loss is over whole micro-batches"
        return
    if "first_step" not in intra:  # bf16 / fp16: losses only (with dropout not even those)
        if stochastic:
            out["ok"], out["intra_needs_halves"] = True, True
            out["intra_tolerance"] = (f"not compared with sequential: other draws of {', '.join(stochastic)} (held "
                                      f"to the half-size run)")
            return
        out["ok"] = loss_diff <= INTRA_LOSS_TOLERANCE_LOW_PRECISION
        out["intra_tolerance"] = f"losses within {INTRA_LOSS_TOLERANCE_LOW_PRECISION:g} of sequential"
        return
    if grad_scale is None:  # no HF reference: scale by sequential's own gradients
        grad_scale = max(1.0, max(float(g.abs().max()) for g in seq["first_step"]["grads"].values()))
    grad_diff = max_diff(intra["first_step"]["grads"], seq["first_step"]["grads"])
    out["max_grad_diff_vs_sequential"] = grad_diff
    out["intra_tolerance"] = f"first-step gradients within {HF_GRAD_TOLERANCE * grad_scale:.3g}" + (
        f" ({stochastic_kinds(opts, stochastic)} off; the trained legs draw other masks / noise)" if stochastic else
        f" and losses within {HF_LOSS_TOLERANCE:g}") + " of sequential"
    out["ok"] = out["hf_close"] is not False and grad_diff <= HF_GRAD_TOLERANCE * grad_scale \
        and (bool(stochastic) or loss_diff <= HF_LOSS_TOLERANCE)


def run_parity(opts: ParityOptions, timeout: float = 600.0) -> dict:
    from ..runtime.spawn import run_ranks
    if opts.pp > 1:
        return run_pipe_parity(opts, timeout)
    return run_ranks(_rank_main, opts.world, args=(opts,), timeout=timeout)[0]


def _rank_many(rank, world, many: list[ParityOptions]):
    return [_rank_main(rank, world, opts) for opts in many]


def run_parities(many: list[ParityOptions], timeout: float = 900.0) -> list[dict]:
    """``run_parity`` of several one-stage option sets in one world (one start-up for all; every set
    must need the same world size), in order."""
    from ..runtime.spawn import run_ranks
    worlds = {opts.world for opts in many}
    if len(worlds) != 1 or any(opts.pp > 1 for opts in many):
        raise ValueError(f"run_parities needs one-stage option sets of one world size, got worlds {sorted(worlds)}")
    return run_ranks(_rank_many, worlds.pop(), args=(list(many),), timeout=timeout)[0]


# ---- pipeline parity: PP=p with a folded schedule vs PP=1 sequential (same TP, DP, data) ----------

# Gradients accumulate over micro-batches in the same order as PP=1 (every chunk runs its
# backwards in micro-batch order), so without clipping (clip=0) the pipeline is bitwise equal.
# With clipping the global grad norm is a sum of squares that PP=p sums per stage (and ZeRO-1 with
# DP > 1 per optimizer partition) before the all-reduce, so the clip factor may differ from PP=1's
# in its last bit and Adam magnifies that.
PP_TOLERANCE = 1e-5


def train_pipeline(opts: ParityOptions, schedule: str, batches) -> dict | None:
    """On every rank of a PP x DP x TP world: train; global rank 0 returns losses and full params."""
    from .pipe_module import gather_hf_state_dict
    out = _train(opts, schedule, batches, lambda engine: gather_hf_state_dict(
        engine.module, engine.groups.tp_grad_group, engine.groups.tp_size))
    return out if out["rank"] == 0 else None


def _rank_pipeline(rank, world, opts: ParityOptions):
    from hf_models.registry import load_config
    _result_note(opts)
    return train_pipeline(opts, opts.schedule, make_batches(opts, load_config(opts.model).vocab_size))


def _rank_reference(rank, world, opts: ParityOptions):
    from hf_models.registry import load_config
    note = _result_note(opts)
    batches = make_batches(opts, load_config(opts.model).vocab_size)
    seq = train_schedule(opts, "sequential", batches)
    hf = None
    if opts.dtype == "fp32":
        seq["first_step"] = first_step(opts, batches)
        hf = train_hf(opts, batches)
    return {"sequential": seq, "hf": hf, "note": note} if rank == 0 else None


def pipe_label(opts: ParityOptions) -> str:
    """Key of the pipelined run in the parity result, e.g. "pp2-w"."""
    return f"pp{opts.pp}-{opts.schedule}"


def run_pipe_parity(opts: ParityOptions, timeout: float = 600.0) -> dict:
    """Two worlds: PP=1 sequential (TP x CP x DP ranks, plus unsharded HF) and PP=p with
    ``opts.schedule`` (PP x TP x DP ranks); same data, same seed."""
    from dataclasses import replace

    from ..runtime.spawn import run_ranks
    ref = run_ranks(_rank_reference, opts.tp * opts.dp * opts.cp, args=(replace(opts, pp=1, schedule="sequential"),),
                    timeout=timeout)[0]
    pipe = run_ranks(_rank_pipeline, opts.world, args=(opts,), timeout=timeout)[0]
    out = compare(opts, ref["sequential"], pipe, ref["hf"], label=pipe_label(opts), note=ref["note"])
    out["pp_tolerance"] = PP_TOLERANCE
    # the pipeline is judged against PP=1 sequential; HF closeness is the sequential run's (reported)
    out["ok"] = out["bitwise_equal"] or out["max_abs_diff_vs_sequential"] <= PP_TOLERANCE
    return out
