"""Fused runs: the COMP ops between two COMM ops of a block run as one op (``dhelix.fuse_ops``).

The executor's unit is an op: each COMP op's forward is recorded from detached inputs and its
backward is one autograd engine call, plus the executor's bookkeeping around it. On a GPU that host
work is paid per op whatever the op's size, so a decoder layer cut into a dozen small ops can leave
the GPU waiting on Python. Between two collectives, though, a strand's ops only follow one another:
reactive SI pairs the strands at the collectives, so they can be one op (a plan's rounds then
pair whole runs: the planner gives up cutting a run between two collectives of the other strand,
e.g. a dense layer's MLP projections; ``"fuse_ops": false`` keeps that choice). ``fuse`` rewrites
each block's runs of consecutive COMP ops as one COMP op:

    [attn.norm] (attn.ag) [attn.qkv] [attn.core] [attn.out] (attn.rs) [mlp.norm] (mlp.ag) [mlp.up] ...
 -> [attn.norm] (attn.ag) [attn.qkv+attn.core+attn.out] (attn.rs) [mlp.norm] (mlp.ag) [mlp.up+...] ...

A fused op reads what its members read before writing it, and writes what later ops (of any
block) read before writing it again, or what no op reads (the loss); names only its members share
stay inside. Its forward runs the members in order on one autograd graph, its backward is one
engine call; it is ``linear`` (may defer its linears' weight gradients) when a member is. The math
is the members', op for op; what an op boundary changes is the memory layout in which the next
op's backward receives its gradient (a leaf's accumulated ``.grad`` against autograd's own buffer),
and a matmul over another layout may round otherwise: fused and unfused runs agree to rounding
(fused tiny-llama gives HF's gradients bit for bit), and SI and sequential over the same fused
graph agree bitwise.

Kept apart: under ``recompute: "selective"`` the ``selective`` ops (each recomputes alone).
"""

from __future__ import annotations

import contextlib
import contextvars

from .model_graph import ModelGraph, Op, OpKind
from .ops import comm_runs

_AROUND: contextvars.ContextVar = contextvars.ContextVar("dhelix_linear_members", default=None)


@contextlib.contextmanager
def around_linear_members(scope):
    """Inside, a fused op runs each of its ``linear`` members inside ``scope(member)`` (a context
    manager: the executor's linear routing where it defers weight gradients), the others without
    it, as they would run unfused."""
    token = _AROUND.set(scope)
    try:
        yield
    finally:
        _AROUND.reset(token)


def fuse(graph: ModelGraph, recompute: str = "none") -> ModelGraph:
    """``graph`` with each block's runs of COMP ops as one op each (in place; returned)."""
    apart = (lambda op: op.selective) if recompute == "selective" else (lambda op: False)
    runs = [_runs(ops, apart) for ops in graph.blocks]
    ops_after = _reads_after(graph.blocks)
    read_anywhere = {k for ops in graph.blocks for op in ops for k in op.inputs}
    fused = []
    for b, block_runs in enumerate(runs):
        out, start = [], 0
        for run in block_runs:
            end = start + len(run)
            live = ops_after[b][end - 1]
            out.append(run[0] if len(run) == 1 else _fused(run, live, read_anywhere))
            start = end
        fused.append(out)
    graph.blocks[:] = fused
    return graph


def _runs(ops: list[Op], apart) -> list[list[Op]]:
    """``ops`` cut into the paper's operator groups (``comm_runs``: each COMM op alone, the COMP ops
    between two together), a kept-apart op alone too."""
    runs: list[list[Op]] = []
    for lo, hi in comm_runs(tuple(op.spec for op in ops)):
        run: list[Op] = []
        for op in ops[lo:hi]:
            if apart(op):
                runs += [run, [op]] if run else [[op]]
                run = []
            else:
                run.append(op)
        if run:
            runs.append(run)
    return runs


def _reads_after(blocks: list[list[Op]]) -> list[list[set]]:
    """Per block and op: the env names read after that op (by later ops of the graph) before being
    written again: what must leave a run ending there."""
    live: set = set()
    out: list[list[set]] = [[set() for _ in ops] for ops in blocks]
    for b in range(len(blocks) - 1, -1, -1):
        for i in range(len(blocks[b]) - 1, -1, -1):
            out[b][i] = set(live)
            op = blocks[b][i]
            live -= set(op.outputs)
            live |= set(op.inputs)
    return out


def _fused(run: list[Op], live: set, read_anywhere: set) -> Op:
    """One COMP op running ``run``'s ops in order; ``live``: the names read after it."""
    inputs, written = [], set()
    for op in run:
        inputs += [k for k in op.inputs if k not in written and k not in inputs]
        written.update(op.outputs)
    outputs = []
    for op in run:
        outputs += [k for k in op.outputs if (k in live or k not in read_anywhere) and k not in outputs]
    members = tuple(run)

    def fn(side, *args):
        env, scope = dict(zip(inputs, args)), _AROUND.get()
        for op in members:
            if scope is not None and op.linear:
                with scope(op):
                    outs = op.fn(side, *(env[k] for k in op.inputs))
            else:
                outs = op.fn(side, *(env[k] for k in op.inputs))
            env.update(zip(op.outputs, outs))
        return tuple(env[k] for k in outputs)

    name = "+".join(op.name for op in run)
    linear = any(op.linear for op in run)
    return Op(name, OpKind.COMP, tuple(inputs), tuple(outputs), fn=fn, linear=linear, members=members)
