"""Host reads of tensor values in one steady-state SI step (CPU, gloo, 2 ranks).

On a GPU every read of a device tensor's value on the host (``.item()``, ``.tolist()``,
``bool(t)``, ``int(t)``, ``torch.tensor(list, device=...)``, a boolean mask index, ``bincount``...)
drains the compute stream, the other strand's queued work included. On CPU nothing syncs, so the
reads are counted instead: a ``TorchFunctionMode`` sees every torch call of the step (the second
``run_microbatches(..., "si", ...)`` of an executor, the first warms it up) and records the reads
with the project line that made them, so a failure names the new sync.

    case (4 micro-batches)           reads per SI step
    tiny-mixtral EP=2                one per MoE layer per micro-batch: the dispatch's split sizes (8)
    tiny-deepseek-v3 EP=2            the same; its first layer is dense (4)
    tiny-mixtral EP=2, cf 1.25       none (capacity mode: fixed, even splits)
    tiny-mixtral EP=2, grouped GEMM  the split sizes only: the GEMM's offsets stay on the device (8)
    tiny-mixtral TP=2 EP=1           one per MoE layer per micro-batch: the loop over experts' sizes (8)
    ... grouped GEMM                 none
    tiny-llama TP=2                  none

The one read that stays is ``HostCopy.read`` (``runtime/comm.py``): the dropless all-to-all takes
its split sizes as Python lists (and a loop over experts its rows per expert). The micro-batches
carry ``loss_denominator`` as the training loop (``ds_dhelix.training``) gives it, so preparing
them reads nothing (without one, ``make_side`` counts the valid targets: one read per micro-batch,
before the step's first op).
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(torch.__file__)
MICRO = 4  # micro-batches of the counted step

VALUE_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "cpu",
    "is_nonzero",
    "equal",
    "allclose",
}
"""Tensor methods and functions that hand a value to the host."""
SYNCING_OPS = {"bincount", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
"""Ops whose output size depends on the values: on CUDA they copy a count to the host first."""


def _has_bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def read_kind(func, args, kwargs) -> str | None:
    """What kind of host read the call ``func(*args, **kwargs)`` is, or None."""
    name = getattr(func, "__name__", "")
    if name in VALUE_READS or name in SYNCING_OPS:
        return name
    if (
        name in ("tensor", "as_tensor")
        and kwargs.get("device") is not None
        and args
        and isinstance(args[0], (list, tuple))
    ):
        return "tensor(list, device=)"
    if name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_bool_index(args[1]):
        return f"{name}[bool mask]"
    if (
        name == "repeat_interleave"
        and len(args) > 1
        and isinstance(args[1], torch.Tensor)
        and kwargs.get("output_size") is None
    ):
        return "repeat_interleave(no output_size)"
    if name == "where" and len(args) == 1:
        return "where(cond)"
    return None


def call_site() -> str:
    """The innermost caller outside torch, this file and other torch-function modes passing the
    call on (the executor's ``wgrad`` interception): ``path:line (function)``, relative to the
    repository (or to the package for transformers)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(TORCH_DIR) and path != __file__ and frame.f_code.co_name != "__torch_function__":
            where = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path.split("site-packages/")[-1]
            return f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values, by (kind, call site), while active."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = read_kind(func, args, kwargs)
        if kind is not None:
            self.sites[f"{kind} at {call_site()}"] += 1
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------ the counted step
def _batches(vocab: int, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(3, vocab, (2, 16), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone(), "loss_denominator": 30.0})
    return out


def count_si_step(graph, model, batches) -> dict:
    """Host reads of the second SI step of a reactive executor on ``graph`` (as the engine builds it)."""
    from ds_dhelix.runtime.executor import Executor
    from ds_dhelix.runtime.memory import ActivationMeter

    ex = Executor(graph, meter=ActivationMeter(model.parameters()))
    ex.run_microbatches(batches, "si", 1.0 / len(batches))  # warm-up: first-step caches
    model.zero_grad(set_to_none=True)
    reads = HostReads()
    with reads:
        ex.run_microbatches(batches, "si", 1.0 / len(batches), first_serial=len(batches))
    return dict(reads.sites)


def _moe_case(rank, preset, tp, ep, capacity_factor, grouped):
    from hf_models.adapters import adapter_for
    from tests.conftest import process_groups
    from tests.test_moe import make_config, make_model

    lay = process_groups(tp=tp, ep=ep)
    config = make_config(preset)
    model = make_model(config)
    graph = adapter_for(config).build_graph(
        model,
        tp,
        lay.tp_rank,
        lay.tp,
        lay.tp_grad_group,
        seed=11,
        ep_groups=lay.expert_groups(),
        capacity_factor=capacity_factor,
        grouped_mm=grouped,
    )
    sparse = len(graph.meta["sparse_layers"])
    return {"reads": count_si_step(graph, model, _batches(config.vocab_size, rank // tp)), "sparse_layers": sparse}


def _dense_case(rank, world):
    from hf_models.adapters import adapter_for
    from tests.conftest import make_config, make_model, process_groups

    layout = process_groups(tp=world)
    config = make_config("tiny-llama")
    model = make_model(config)
    graph = adapter_for(config).build_graph(model, world, layout.tp_rank, layout.tp, layout.tp_grad_group)
    return {"reads": count_si_step(graph, model, _batches(config.vocab_size, 0)), "sparse_layers": 0}


CASES = {  # name: (preset, tp, ep, capacity factor, grouped GEMM, split-size reads per MoE layer per micro-batch)
    "tiny-mixtral": ("tiny-mixtral", 1, 2, None, False, 1),
    "tiny-deepseek-v3": ("tiny-deepseek-v3", 1, 2, None, False, 1),
    "tiny-mixtral-capacity": ("tiny-mixtral", 1, 2, 1.25, False, 0),
    "tiny-mixtral-grouped": ("tiny-mixtral", 1, 2, None, True, 1),  # the GEMM's offsets stay on the device
    "tiny-mixtral-tp2-ep1": ("tiny-mixtral", 2, 1, None, False, 1),  # the loop over experts reads its sizes
    "tiny-mixtral-tp2-ep1-grouped": ("tiny-mixtral", 2, 1, None, True, 0),
}


def _rank_main(rank, world):
    torch.manual_seed(0)
    out = {name: _moe_case(rank, *case[:5]) for name, case in CASES.items()}
    out["tiny-llama-tp2"] = _dense_case(rank, world)
    return out


@pytest.fixture(scope="module")
def counted():
    return run_ranks(_rank_main, 2, timeout=600)


SPLIT_READ = "tolist at ds_dhelix/runtime/comm.py"
"""The one read that stays: the split sizes (``HostCopy.read``)."""


def _describe(reads: dict) -> str:
    return "\n".join(f"  {n} x {site}" for site, n in sorted(reads.items())) or "  (none)"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [*CASES, "tiny-llama-tp2"])
def test_si_step_host_reads(counted, case):
    """Exactly the split-size reads (one per MoE layer per micro-batch where the case needs them), nothing else."""
    per_layer = CASES[case][5] if case in CASES else 0
    for rank, res in enumerate(counted):
        got = res[case]
        reads = got["reads"]
        want = got["sparse_layers"] * MICRO * per_layer
        splits = sum(n for site, n in reads.items() if site.startswith(SPLIT_READ))
        others = {site: n for site, n in reads.items() if not site.startswith(SPLIT_READ)}
        assert not others and splits == want, (
            f"{case}, rank {rank}: expected {want} split-size reads and nothing else, got:\n{_describe(reads)}"
        )


# ------------------------------------------------------------------------------ the device-side pieces
def _reference_expert_major_index(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation as the host loop built it before (``cnt = recv_counts.tolist()``)."""
    ep, local = recv_counts.shape
    cnt, start, starts = recv_counts.tolist(), 0, []
    for s in range(ep):
        starts.append([])
        for e in range(local):
            starts[s].append(start)
            start += cnt[s][e]
    pieces = [torch.arange(starts[s][e], starts[s][e] + cnt[s][e]) for e in range(local) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def test_expert_major_index_on_the_device_is_the_host_loops():
    from ds_dhelix.moe.experts import expert_major_index

    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 2), (4, 3), (1, 4), (3, 1)]
    for ep, local in shapes:
        for high in (1, 3, 6):  # many zero counts with high = 1
            counts = torch.randint(0, high, (ep, local), generator=gen)
            got = expert_major_index(counts, int(counts.sum()))
            assert torch.equal(got, _reference_expert_major_index(counts)), counts


def _reference_capacity_encode(x, selected, num_experts, cf):
    """The send buffer capacity mode built before: boolean masks and ``index_copy``."""
    from ds_dhelix.moe.router import capacity_for

    n_tok, k = selected.shape
    sel = selected.reshape(-1)
    order = torch.argsort(sel, stable=True)
    counts = torch.bincount(sel, minlength=num_experts)
    cap = capacity_for(n_tok, k, num_experts, cf)
    sorted_sel = sel[order]
    pos = torch.arange(order.numel()) - (torch.cumsum(counts, 0) - counts)[sorted_sel]
    keep = pos < cap
    slot = sorted_sel * cap + pos
    token_of = torch.div(order, k, rounding_mode="floor")[keep]
    return x.new_zeros(num_experts * cap, x.shape[-1]).index_copy(0, slot[keep], x.index_select(0, token_of)), int(
        (~keep).sum()
    )


@pytest.mark.parametrize("cf", [0.5, 1.0, 4.0])
def test_capacity_route_with_fixed_shapes_is_bitwise_the_masked_one(cf):
    """Send buffer, gradient to the tokens and dropped count as the masked version gave them."""
    from ds_dhelix.moe.router import route_tokens

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 8, generator=gen)
    selected = torch.randint(0, 3, (23, 2), generator=gen)  # expert 3 of 4 gets nothing
    g = torch.randn(4 * 46, 8, generator=gen)  # (46 slots per expert at cf 4)
    results = []
    for build in ("fixed", "masked"):
        leaf = x.clone().requires_grad_()
        if build == "fixed":
            buf, route = route_tokens(leaf, selected, 4, cf)
            dropped = int(route.dropped)
        else:
            buf, dropped = _reference_capacity_encode(leaf, selected, 4, cf)
        buf.backward(g[: buf.shape[0]])
        results.append((buf.detach(), leaf.grad, dropped))
    (b1, g1, d1), (b2, g2, d2) = results
    assert torch.equal(b1, b2) and torch.equal(g1, g2) and d1 == d2
    assert (d1 > 0) == (cf < 4.0)


def test_grouped_linear_takes_device_sizes():
    """The grouped GEMM with the rows per expert as a device tensor (no host list) is the one with a list."""
    from ds_dhelix.moe.experts import expert_linear

    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(10, 8, generator=gen), torch.randn(3, 16, 8, generator=gen), torch.randn(3, 16, generator=gen)
    sizes = [4, 0, 6]
    with_list = expert_linear(x, sizes, w, True, b)
    with_tensor = expert_linear(x, torch.tensor(sizes), w, True, b)
    assert torch.equal(with_list, with_tensor)
    assert torch.allclose(with_list, expert_linear(x, sizes, w, False, b), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="host list"):
        expert_linear(x, torch.tensor(sizes), w, False)


def test_host_copy_on_cpu_is_the_tensor_itself():
    """CPU: no stream, no copy, no event; the same calls as on CUDA, read as lists."""
    from ds_dhelix.runtime.comm import HostCopies

    copies = HostCopies()
    t = torch.tensor([[1, 2], [3, 4]])
    copy = copies.start(t)
    assert copy.host is t and copy.event is None and copies._stream is None
    assert copy.read() == [[1, 2], [3, 4]]


def test_step_moe_numbers_are_read_once_at_the_end():
    """The routers' load and dropped copies and the aux loss stay on the device while the step runs;
    the engine reads them on the host once, after their reduction (values as the router counted)."""
    from types import SimpleNamespace

    from ds_dhelix.engine.moe_engine import DhelixMoeEngine
    from ds_dhelix.moe.metrics import MoeMetrics
    from ds_dhelix.moe.router import route_tokens

    metrics = MoeMetrics(num_layers=2, num_experts=4)
    x, selected = torch.randn(6, 3), torch.tensor([[0, 1]] * 5 + [[2, 3]])
    reads = HostReads()
    with reads:
        for layer in (0, 1):
            _, route = route_tokens(x, selected, 4, capacity_factor=1.0)  # 4 copies dropped (test_moe)
            metrics.record_route(layer, route.counts, route.dropped)
        metrics.record_aux(torch.tensor(0.25))
    assert dict(reads.sites) == {}
    engine = SimpleNamespace(moe_metrics=metrics, groups=SimpleNamespace(cp_size=1, dp_size=1))
    with reads:
        DhelixMoeEngine._reduce_moe_metrics(engine)
    assert [site.split(" at ")[0] for site in reads.sites] == ["tolist"] and sum(reads.sites.values()) == 1
    assert engine.moe_dropped_tokens == 8 and engine.moe_aux_loss == 0.25
    assert engine.moe_expert_load.tolist() == [[5.0, 5.0, 1.0, 1.0]] * 2
