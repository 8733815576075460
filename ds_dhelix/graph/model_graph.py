"""Op graphs: a model as blocks of named ops that the executor runs one by one.

A ``ModelGraph`` has blocks ``[pre, layer 0, ..., layer L-1, post]``: ``pre`` turns token ids into
the (sequence-sharded) hidden state, each layer block is a decoder layer's op list, ``post`` ends
in the loss. Ops read and write named tensors of one micro-batch's environment (``env``):

    COMP op: outputs = fn(side, *inputs)   (HF modules' math through autograd)
    COMM op: outputs[0] = collective(inputs[0])   (body.forward / body.backward, asynchronous)

``side`` holds the micro-batch's non-differentiable inputs (token ids, targets, rotary cos/sin).
Names are stable strings shared with plans, tables and traces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .ops import OpKind, OpSpec


@dataclass(frozen=True)
class Op:
    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable | None = None  # COMP only
    comm: object | None = None  # COMM only: body with forward / backward(x, side, channel) -> Pending
    linear: bool = False  # COMP: linear on the way to its weights (matmuls, views, row selection)
    selective: bool = False  # COMP: recomputed under recompute "selective" (much to save, cheap to redo)
    members: tuple = ()  # COMP: the ops a fused op runs in order (``fuse.py``); () for an op of its own

    @property
    def is_comm(self) -> bool:
        return self.kind is OpKind.COMM

    @property
    def spec(self) -> OpSpec:
        return OpSpec(self.name, self.kind)


def comp(name, inputs, outputs, fn, linear: bool = False, selective: bool = False) -> Op:
    """A COMP op ``outputs = fn(side, *inputs)``. ``linear``: every autograd step between its
    outputs and its weights is linear (a projection and views or row selection, no activation or
    norm on that path), so the executor may compute its weight gradient as a later, separate pass
    that costs only the weight matmuls (see ``Executor``). ``selective``: what ``recompute:
    "selective"`` recomputes (an op that saves much more than its inputs: the attention core, an
    activation)."""
    return Op(name, OpKind.COMP, tuple(inputs), tuple(outputs), fn=fn, linear=linear, selective=selective)


def comm(name, body, src, dst) -> Op:
    """A COMM op reading ``src`` and writing ``dst``; ``body`` launches its collectives
    (see ``ds_dhelix.runtime.comm``: ``SeqAllGather``, ``SeqReduceScatter``, MoE all-to-alls)."""
    return Op(name, OpKind.COMM, (src,), (dst,), comm=body)


@dataclass
class ModelGraph:
    """A model as ``blocks`` of ops plus what the executor needs around them.

    ``make_side(batch, serial) -> dict`` builds a micro-batch's side inputs from ``{"input_ids",
    "labels"}`` and its number in the run (``serial``: what seeds its random draws);
    the last op of the last block writes ``"loss"``: this rank's share of the micro-batch loss
    (shares sum over the TP group to the full loss). ``replicated`` (a ``comm.ReplicatedGrads``,
    None without TP): weights whose gradients the executor sums over the TP group after a step's
    last backward.
    """

    blocks: list[list[Op]]
    make_side: Callable[..., dict]
    family: str = ""
    meta: dict = field(default_factory=dict)
    replicated: object | None = None

    @property
    def is_moe(self) -> bool:
        """Whether the graph has expert layers (its builder recorded their expert groups)."""
        return "expert_groups" in self.meta

    @property
    def num_layers(self) -> int:
        return len(self.blocks) - 2

    def block_specs(self, block: int) -> tuple[OpSpec, ...]:
        """Op list of block ``block`` (1 .. num_layers: decoder layer ``block - 1``)."""
        return tuple(op.spec for op in self.blocks[block])

    def layer_kinds(self) -> dict[tuple[OpSpec, ...], list[int]]:
        """Each kind of decoder layer (its op list) -> its blocks: one kind for most models; a dense
        layer among MoE ones (``first_k_dense_replace``, ``mlp_only_layers``) is a kind of its own."""
        kinds: dict[tuple[OpSpec, ...], list[int]] = {}
        for b in range(1, len(self.blocks) - 1):
            kinds.setdefault(self.block_specs(b), []).append(b)
        return kinds

    def main_block(self) -> int:
        """The first block of the main layer kind: the kind most layers have (ties: the last layer's)."""
        kinds = self.layer_kinds()
        last = self.block_specs(len(self.blocks) - 2)
        best = max(kinds, key=lambda k: (len(kinds[k]), k == last))
        return kinds[best][0]

    def layer_specs(self) -> tuple[OpSpec, ...]:
        """Op list of the main layer kind (every layer's, when all share one): what the planner
        profiles and plans; pairs with a layer of another kind run by their default plan."""
        return self.block_specs(self.main_block())
