"""LoRA from a PEFT model, sharded with its base projection (the Megatron-style split).

``from_peft(model)`` takes a ``peft.PeftModel`` with one LoRA adapter and returns the HF model
inside it, each LoRA layer replaced by its base projection carrying the adapter's factors as
parameters of its own::

    base.weight   the frozen projection (nn.Linear [out, in], or GPT-2's Conv1D [in, out])
    base.lora_A   [r, in]     the PEFT ``lora_A`` weight (the same Parameter object)
    base.lora_B   [out, r]    the PEFT ``lora_B`` weight
    base.lora_scaling         alpha / r (or alpha / sqrt(r) with rsLoRA)

The base module's class becomes a subclass whose forward adds ``scaling * B(A(x))``, so every op
that calls the module computes the adapter; an op that uses only a weight (a row-parallel
projection without its bias) calls ``common.project``. ``common.shard_param`` cuts the factors with
their base: a column-parallel base (split by output rows) keeps A whole and B's rows; a
row-parallel base (split by input columns) keeps A's columns and B whole, so each rank's partial
product is summed by the base's own reduce-scatter. The whole factors see only part of the work on
each rank: their gradients are summed over the TP group with the other replicated weights
(``replicated_factors``).

What the engine cannot honour is refused in one line (``check_peft``): another adapter type than
LoRA, DoRA, LoRA biases, ``modules_to_save``, trainable tokens, several adapters, a merged adapter,
or a target module the family's op graph does not call (``lora_targets`` of the adapter). ``adapter_tensors`` and
``adapter_config`` give back PEFT's files; ``merged`` the base weights with the adapter added.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ds_dhelix.runtime import wgrad

from .expert_lora import check_wrapper, expert_factors, is_expert_factor, is_wrapper, peft_tensor, take_wrappers
from .expert_lora import merged as expert_merged


@dataclass
class LoraInfo:
    """What the exports need of the adapter, kept from the whole model (a pipeline stage holds
    only its layers): its PEFT config, and each wrapped module's scaling and weight layout."""

    config: object  # the peft LoraConfig (writes adapter_config.json)
    scales: dict[str, float]  # module path ("model.layers.0.self_attn.q_proj") -> alpha / r
    conv1d: frozenset[str]  # paths of GPT-2 Conv1D modules (weight stored [in, out])
    shapes: dict[str, tuple]  # factor name ("<path>.lora_A") -> its full shape
    experts: dict = field(default_factory=dict)  # "<experts path>.<tensor>" -> expert_lora.ExpertAdapter

    def owner(self, name: str) -> tuple[str, str] | None:
        """``(module path, leaf)`` of a parameter of a wrapped module, else None."""
        path, _, leaf = name.rpartition(".")
        return (path, leaf) if path in self.scales else None


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def has_lora(module: nn.Module) -> bool:
    return getattr(module, "lora_A", None) is not None


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: ``y = x @ W + b``, ``W`` stored [in, out]."""
    return type(module).__name__.endswith("Conv1D")


def lora_term(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``scaling * B(A(dropout(x)))`` of a module carrying LoRA factors (the dropout while training,
    with ``lora_dropout`` > 0: ``use_dropout``)."""
    drop = getattr(module, "lora_drop", None)
    if drop is not None and module.training:
        x = dropped(module, x, drop)
    return wgrad.linear(wgrad.linear(x, module.lora_A), module.lora_B) * module.lora_scaling


@dataclass(frozen=True)
class LoraDrop:
    """One wrapped module's dropout of its LoRA input: rate ``p``, seeded by (``seed``, micro-batch,
    ``replica``, ``key``) and drawn over the ``full_in`` input features of the whole module."""

    p: float
    seed: int
    replica: int  # the data-parallel x context-parallel position: other data, other masks
    key: str  # "lora:<module path>"
    full_in: int


def use_dropout(model: nn.Module, seed: int, replica: int) -> bool:
    """Give every wrapped module of ``model`` (after ``from_peft``; its ``dhelix_lora`` set) PEFT's
    ``lora_dropout`` as a ``LoraDrop``; True when there is one. The masks do not depend on the
    schedule (the micro-batch's number seeds them: SI draws what sequential does, a recomputed
    forward what the first did) nor on the TP rank: each is drawn over the module's whole input
    ([sequence, batch, in], the same on every TP rank of a column-parallel module, which sees the
    whole sequence), a row-parallel module keeping its input columns of it; so TP=2 masks what TP=1
    does."""
    info = getattr(model, "dhelix_lora", None)
    p = float(getattr(info.config, "lora_dropout", 0.0) or 0.0) if info is not None else 0.0
    if not p:
        return False
    for path, module in model.named_modules():
        if has_lora(module):
            module.lora_drop = LoraDrop(p, seed, replica, f"lora:{path}", info.shapes[f"{path}.lora_A"][1])
    return True


def dropped(module: nn.Module, x: torch.Tensor, drop: LoraDrop) -> torch.Tensor:
    """``x`` [..., in (this rank's columns)] with the micro-batch's mask of ``drop`` applied."""
    from ds_dhelix.graph.draws import current_side, draw_seed, seeded_rng

    side = current_side()
    if side is None:
        raise RuntimeError(
            f"{drop.key[5:]}: LoRA dropout draws its masks per micro-batch inside the engine's op graph; this "
            f"module was called outside it while training (call the model through the engine, or eval())"
        )
    with seeded_rng(x.device, draw_seed(drop.seed, side["serial"], 0, drop.replica, drop.key)):
        keep = torch.empty((*x.shape[:-1], drop.full_in), device=x.device, dtype=x.dtype).bernoulli_(1 - drop.p)
    cols = (getattr(module.lora_A, "hf_selection", None) or {}).get(1)
    if cols is not None:
        keep = keep[..., cols] if isinstance(cols, slice) else keep.index_select(-1, cols.to(x.device))
    return x * keep / (1 - drop.p)


def project(module: nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``module``'s projection of ``x`` (nn.Linear or Conv1D: their forward's own calls, through
    ``wgrad``'s routing, so a deferring op needs no mode for them; another module: called), its
    LoRA term added when it has one; ``bias=False``: without the bias (a row-parallel bias is added
    once, after the reduce-scatter). (Called per projection per micro-batch: kept lean.)"""
    lora = module._parameters.get("lora_A") is not None  # has_lora, without a failing getattr
    cls = type(module).__mro__[1] if lora else type(module)  # a wrapped module's own class
    b = module.bias if bias else None
    if cls is nn.Linear:  # (not a subclass: it may have its own forward)
        base = wgrad.linear(x, module.weight, b)
    elif is_conv1d(module):
        if b is None:
            base = wgrad.matmul(x, module.weight)
        else:
            base = wgrad.addmm(b, x.view(-1, x.size(-1)), module.weight).view(x.size()[:-1] + (module.nf,))
    elif bias:
        base = cls.forward(module, x) if lora else module(x)
    else:
        base = F.linear(x, module.weight)
    return base + lora_term(module, x) if lora else base


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    """``cls`` whose forward adds the module's LoRA term (one subclass per base class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Lora{cls.__name__}",
            (cls,),
            {
                "forward": lambda self, x: project(self, x),
                "__doc__": f"{cls.__name__} with a LoRA term (ds_dhelix.hf_models.lora)",
            },
        )
    return _CLASSES[cls]


def check_peft(peft_model, targets: tuple[str, ...], family: str) -> None:
    """``ValueError`` naming what of the PEFT model the engine cannot honour, if anything."""
    configs = peft_model.peft_config
    if len(configs) != 1:
        raise ValueError(
            f"the PEFT model holds {len(configs)} adapters ({', '.join(configs)}); ds_dhelix trains one: "
            f"delete the others (delete_adapter) before initialize"
        )
    ((name, cfg),) = configs.items()
    check_config(cfg)
    for path, module in peft_model.base_model.model.named_modules():
        if is_wrapper(module):  # target_parameters: the experts' fused tensors
            check_wrapper(path, module)
        elif hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            _check_layer(path, module, name, targets, family)


def target_names(targets: tuple[str, ...]) -> list[str]:
    """The module names ``target_modules`` may give for an adapter's ``LORA_TARGETS``."""
    return sorted({t.split(".")[-1] for t in targets})


def check_config(cfg) -> None:
    """``ValueError`` naming the first setting of a PEFT config the engine cannot honour."""
    kind = getattr(cfg.peft_type, "value", cfg.peft_type)
    if kind != "LORA":
        raise ValueError(f"PEFT adapter type {kind}: ds_dhelix shards and schedules LoRA only; use a LoraConfig")
    refusals = [
        (
            getattr(cfg, "use_dora", False),
            "use_dora=True (DoRA's magnitude vector needs the whole weight's norm on every rank)",
            "use_dora=False",
        ),
        (
            getattr(cfg, "bias", "none") != "none" or getattr(cfg, "lora_bias", False),
            f"bias={cfg.bias!r} / lora_bias={getattr(cfg, 'lora_bias', False)} (trained biases)",
            "bias='none'",
        ),
        (
            bool(getattr(cfg, "modules_to_save", None)),
            f"modules_to_save={cfg.modules_to_save} (fully trained copies of modules)",
            "modules_to_save=None",
        ),
        (bool(getattr(cfg, "trainable_token_indices", None)), "trainable_token_indices", "leave it unset"),
        (bool(getattr(cfg, "layer_replication", None)), "layer_replication", "leave it unset"),
        (
            bool(getattr(cfg, "target_parameters", None)) and bool(cfg.lora_dropout),
            f"target_parameters and lora_dropout={cfg.lora_dropout} (PEFT's LoRA on the experts' fused "
            f"tensors has no dropout: its ParamWrapper refuses it)",
            "lora_dropout=0, or LoRA with dropout on the attention projections only (no target_parameters)",
        ),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ValueError(f"PEFT LoRA config with {what} is not supported by ds_dhelix; use {fix}")


def _check_layer(path: str, module, adapter: str, targets: tuple[str, ...], family: str) -> None:
    if getattr(module, "merged", False):
        raise ValueError(
            f"LoRA layer {path} is merged into its base weight; unmerge it (unmerge_adapter()) or "
            f"train the merged model without PEFT"
        )
    if (
        not isinstance(module.lora_A, nn.ModuleDict)
        or adapter not in module.lora_A
        or not isinstance(module.base_layer, nn.Linear)
        and type(module.base_layer).__name__ != "Conv1D"
    ):
        raise ValueError(
            f"LoRA layer {path} ({type(module.base_layer).__name__}) is not a LoRA linear layer; "
            f"target linear projections only"
        )
    if not any(re.fullmatch(rf"(.*\.)?\d+\.{re.escape(t)}", path) for t in targets):
        raise ValueError(
            f"LoRA on {path}: the {family} op graph does not call that module with an adapter; "
            f"target_modules may name: {', '.join(target_names(targets))}"
        )


def from_peft(model, targets: tuple[str, ...], family: str):
    """``(hf_model, LoraInfo)`` for a PEFT model (its LoRA layers turned into base projections
    carrying their factors, see the module docstring), ``(model, None)`` for any other model. The
    PEFT model is changed in place: its ``save_pretrained`` would find no LoRA layer left and write
    an empty adapter, so it raises instead, naming ``engine.export_adapter``."""
    if not is_peft_model(model):
        return model, None
    check_peft(model, targets, family)
    adapter, config = next(iter(model.peft_config.items()))
    hf = model.base_model.model
    experts = take_wrappers(hf, adapter)
    scales, conv1d, shapes = {}, set(), {}
    for path, module in list(hf.named_modules()):
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        base = module.base_layer
        base.lora_A = module.lora_A[adapter].weight
        base.lora_B = module.lora_B[adapter].weight
        base.lora_scaling = float(module.scaling[adapter])
        base.__class__ = _lora_class(type(base))
        parent, _, leaf = path.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, leaf, base)
        scales[path] = base.lora_scaling
        shapes[f"{path}.lora_A"], shapes[f"{path}.lora_B"] = tuple(base.lora_A.shape), tuple(base.lora_B.shape)
        if is_conv1d(base):
            conv1d.add(path)
    model.save_pretrained = _handed_over
    return hf, LoraInfo(config, scales, frozenset(conv1d), shapes, experts)


def _handed_over(*args, **kwargs):
    raise RuntimeError(
        "this PEFT model was given to ds_dhelix.initialize, which moved its LoRA layers into the "
        "sharded engine; save the adapter with engine.export_adapter(DIR) (DhelixTrainer.save_model "
        "does) and the merged model with engine.export_hf(DIR)"
    )


def init_meta_factors(model: nn.Module, seed: int) -> int:
    """Draw the factors PEFT could not (a model built on the meta device has none to draw): A as
    PEFT does (Kaiming-uniform, a=sqrt(5)) from ``seed`` and the module's path, B zeros; each rank
    keeps its shard of the full factor (``hf_selection``), so every TP layout starts from the same
    adapter. Returns how many factors were drawn."""
    import math
    import zlib

    info = getattr(model, "dhelix_lora", None)
    drawn = 0
    for name, p in model.named_parameters():
        if not (p.is_meta and is_factor_name(name)):
            continue
        if is_expert_factor(name):
            raise ValueError(
                f"LoRA target_parameters on {name[: -len('_lora_A')]} of a model built on the meta device (sharded "
                f"loading): ds_dhelix does not draw expert factors there yet; load the model whole, apply the "
                f"adapter, then initialize"
            )
        init = info.config.init_lora_weights
        if init is not True:
            raise ValueError(
                f"LoRA init_lora_weights={init!r} on a model built on the meta device (sharded loading): "
                f"ds_dhelix draws the factors as PEFT's default does (A Kaiming-uniform, B zero) and "
                f"cannot draw that one; use init_lora_weights=True, or load the model whole and "
                f"initialize the adapter before initialize"
            )
        full = torch.zeros(info.shapes[name], dtype=p.dtype)
        if name.endswith(".lora_A"):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)) over fan_in = in
            full = (torch.rand(full.shape, generator=g) * 2 - 1).mul_(bound).to(p.dtype)
        for dim, sel in (getattr(p, "hf_selection", None) or {}).items():
            idx = torch.arange(*sel.indices(full.shape[dim])) if isinstance(sel, slice) else sel
            full = full.index_select(dim, idx)
        keep = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(full.contiguous(), requires_grad=p.requires_grad))
        p.__dict__.update(keep)
        drawn += 1
    return drawn


def shard_factors(module: nn.Module, name: str, dim: int, rank: int, tp: int, index, shard_param) -> None:
    """After ``module.<name>`` (its weight) is cut along ``dim``: cut the factor that shares that dim
    (B by output rows, A by input columns) the same way."""
    if name != "weight" or not has_lora(module):
        return
    out_dim = 1 if is_conv1d(module) else 0
    if dim == out_dim:
        shard_param(module, "lora_B", 0, rank, tp, index=index)
    else:
        shard_param(module, "lora_A", 1, rank, tp, index=index)


def merged_stream(stream, info: LoraInfo):
    """An export's ``(name, full tensor)`` stream with each wrapped module's factors folded into
    its base weight (``W + scaling * B @ A``) and left out: a plain HF checkpoint of the trained
    model. A module's three tensors are held until all have come (one module at a time)."""
    held: dict[str, dict] = {}
    for name, full in stream:
        expert = name if name in info.experts else name[:-7] if is_expert_factor(name) else None
        if expert in info.experts:  # an expert tensor or one of its factors
            parts = held.setdefault(expert, {})
            parts[name[len(expert) :] or "weight"] = full
            if len(parts) == 3:
                del held[expert]
                w, a, b = parts["weight"], parts["_lora_A"], parts["_lora_B"]
                yield expert, None if w is None else expert_merged(w, a, b, info.experts[expert])
            continue
        owner = info.owner(name)
        if owner is None or owner[1] not in ("weight", "lora_A", "lora_B"):
            yield name, full
            continue
        path, leaf = owner
        parts = held.setdefault(path, {})
        parts[leaf] = full
        if len(parts) == 3:
            del held[path]
            w, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
            yield f"{path}.weight", None if w is None else merge(w, a, b, info.scales[path], path in info.conv1d)
    if held:
        raise RuntimeError(f"LoRA merge: modules {sorted(held)[:3]} lack a weight or a factor in the export stream")


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, conv1d: bool) -> torch.Tensor:
    """The full base ``weight`` with the full factors' product added, in the weight's dtype."""
    delta = (b.float() @ a.float()) * scaling  # [out, in]
    return (weight.float() + (delta.T if conv1d else delta)).to(weight.dtype)


def factors(model: nn.Module) -> list[nn.Parameter]:
    """Every LoRA factor of ``model`` (after ``from_peft``)."""
    return [p for m in model.modules() if has_lora(m) for p in (m.lora_A, m.lora_B)]


def has_adapter(model: nn.Module) -> bool:
    """Any LoRA factor, on a projection or an experts' tensor."""
    return bool(factors(model) or expert_factors(model))


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model as its frozen base: every adapter's scaling 0 inside (its term adds exact zeros),
    restored after (a preference objective's reference pass)."""
    wrapped = [m for m in model.modules() if has_lora(m)]
    scales = [m.lora_scaling for m in wrapped]
    experts = [m for m in model.modules() if getattr(m, "lora_scalings", None)]
    expert_scales = [m.lora_scalings for m in experts]
    for m in wrapped:
        m.lora_scaling = 0.0
    for m in experts:
        m.lora_scalings = dict.fromkeys(m.lora_scalings, 0.0)
    try:
        yield
    finally:
        for m, s in zip(wrapped, scales):
            m.lora_scaling = s
        for m, s in zip(experts, expert_scales):
            m.lora_scalings = s


def is_factor_name(name: str) -> bool:
    """A LoRA factor's name: a projection's (``.lora_A``) or an expert tensor's (``_lora_A``)."""
    return name.endswith((".lora_A", ".lora_B")) or is_expert_factor(name)


def adapter_file_tensor(name: str, full: torch.Tensor, info: LoraInfo) -> tuple[str, torch.Tensor]:
    """A factor's full tensor as PEFT's adapter file holds it: ``(key, tensor)``."""
    return peft_tensor(name, full, info.experts) if is_expert_factor(name) else (peft_key(name), full)


def peft_key(name: str) -> str:
    """PEFT's file key of a factor: ``model.layers.0.self_attn.q_proj.lora_A`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"base_model.model.{name}.weight"


def our_name(peft_name: str) -> str:
    """A PEFT model's parameter name as the engine's model names it:
    ``base_model.model.X.base_layer.weight`` -> ``X.weight``, ``...X.lora_A.default.weight`` ->
    ``X.lora_A``; a plain model's names are unchanged."""
    name = peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1", name)
