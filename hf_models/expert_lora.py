"""LoRA on MoE experts' fused tensors: PEFT's ``target_parameters`` ("experts.gate_up_proj",
"experts.down_proj"), taken out of PEFT's wrappers and kept expert-major, so that EP shards them
with their experts.

PEFT wraps the experts module in one ``ParamWrapper`` per targeted tensor (nested: the first
target innermost) with ``lora_A [E x r, in]`` (expert e's rows ``e r : (e + 1) r``) and
``lora_B [out, r x E]`` (expert e's columns ``e, E + e, 2E + e, ...``); expert e's update is
``scaling x B_e @ A_e`` ([out, in], transposed for a tensor stored [E, in, out], gpt-oss's). Here
the experts module carries them as

    <tensor>_lora_A   [E, r, in]    A.reshape(E, r, in)
    <tensor>_lora_B   [E, out, r]   B.reshape(out, r, E).permute(2, 0, 1)
    lora_scalings     {tensor: alpha / r}

so every factor has the experts on its first dimension: ``moe.experts.shard_experts`` keeps this
EP rank's experts of them as of the weights, ZeRO reduces them over the expert-data-parallel
group, ``gather_expert_param`` rebuilds them, and the expert computation uses
``W + scaling x B @ A`` (``moe.experts.expert_weight``). The exports write PEFT's layout and keys
back (``peft_tensor``) or fold the update into the weights (``merged``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

EXPERT_TENSORS = ("gate_up_proj", "down_proj")
SUFFIXES = ("_lora_A", "_lora_B")


@dataclass(frozen=True)
class ExpertAdapter:
    """One expert tensor's adapter as PEFT saves it."""

    peft_prefix: str  # "base_model.model.<wrapper path>": PEFT's keys are <prefix>.lora_A.weight / .lora_B.weight
    rank: int
    experts: int
    transposed: bool  # the tensor is stored [E, in, out] (``x @ W``): the update is transposed
    scaling: float


def is_wrapper(module: nn.Module) -> bool:
    """PEFT's ``ParamWrapper`` (LoRA on a parameter, ``target_parameters``)."""
    return hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def check_wrapper(path: str, module: nn.Module) -> None:
    """``ValueError`` for a ``target_parameters`` target the engine does not train: anything but the
    experts' fused ``gate_up_proj`` / ``down_proj`` (the routers, a 2-D weight)."""
    name = module.parameter_name
    inner = module
    while is_wrapper(inner):
        inner = inner.base_layer
    tensor = getattr(inner, name, None)
    if name not in EXPERT_TENSORS or tensor is None or tensor.dim() != 3:
        raise ValueError(
            f"LoRA target_parameters on {path}.{name}: ds_dhelix trains LoRA on the experts' fused tensors "
            f"(experts.gate_up_proj, experts.down_proj); the routers and other parameters are not supported yet"
        )


def take_wrappers(hf: nn.Module, adapter: str) -> dict[str, ExpertAdapter]:
    """Every experts module of ``hf`` wrapped by PEFT: its factors moved onto it expert-major
    (module docstring), the outermost wrapper replaced by it. Returns ``{"<experts path>.<tensor>":
    ExpertAdapter}``."""
    found: dict[str, ExpertAdapter] = {}
    inner = {id(m.base_layer) for m in hf.modules() if is_wrapper(m)}
    for path, module in list(hf.named_modules()):
        if not is_wrapper(module) or id(module) in inner:
            continue
        chain, where = [], path
        while is_wrapper(module):
            chain.append((where, module))
            where, module = f"{where}.base_layer", module.base_layer
        experts, scalings = module, dict(getattr(module, "lora_scalings", {}))
        for wrapper_path, w in chain:
            name, e, r = w.parameter_name, w.num_experts, w.r[adapter]
            a, b = w.lora_A[adapter].weight, w.lora_B[adapter].weight
            a3 = a.detach().reshape(e, r, a.shape[1]).clone()
            b3 = b.detach().reshape(b.shape[0], r, e).permute(2, 0, 1).contiguous()
            setattr(experts, f"{name}_lora_A", nn.Parameter(a3, requires_grad=a.requires_grad))
            setattr(experts, f"{name}_lora_B", nn.Parameter(b3, requires_grad=b.requires_grad))
            scalings[name] = float(w.scaling[adapter])
            transposed = not w._did_swap_in_out_features
            found[f"{path}.{name}"] = ExpertAdapter(
                f"base_model.model.{wrapper_path}", r, e, transposed, scalings[name]
            )
        experts.lora_scalings = scalings
        parent, _, leaf = path.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, leaf, experts)
    return found


def expert_factors(model: nn.Module) -> list[nn.Parameter]:
    """Every expert factor of ``model`` (after ``take_wrappers``)."""
    return [
        getattr(m, f"{t}{s}")
        for m in model.modules()
        if getattr(m, "lora_scalings", None)
        for t in EXPERT_TENSORS
        if getattr(m, f"{t}_lora_A", None) is not None
        for s in SUFFIXES
    ]


def is_expert_factor(name: str) -> bool:
    return name.endswith(SUFFIXES)


def peft_tensor(name: str, full: torch.Tensor, adapters: dict[str, ExpertAdapter]) -> tuple[str, torch.Tensor]:
    """An expert factor's full tensor (ours, expert-major) as PEFT's file holds it: ``(key, tensor)``."""
    spec = adapters[name[: -len("_lora_A")]]
    e, r = spec.experts, spec.rank
    if name.endswith("_lora_A"):
        return f"{spec.peft_prefix}.lora_A.weight", full.reshape(e * r, full.shape[-1])
    return f"{spec.peft_prefix}.lora_B.weight", full.permute(1, 2, 0).reshape(full.shape[1], r * e)


def update(a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool) -> torch.Tensor:
    """Every expert's ``scaling x B_e @ A_e`` ([E, out, in]; [E, in, out] when ``transposed``)."""
    delta = torch.bmm(b, a) * scaling
    return delta.transpose(1, 2) if transposed else delta


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spec: ExpertAdapter) -> torch.Tensor:
    """The full expert tensor with its adapter folded in (fp32 sum), in the weight's dtype."""
    return (weight.float() + update(a.float(), b.float(), spec.scaling, spec.transposed)).to(weight.dtype)
