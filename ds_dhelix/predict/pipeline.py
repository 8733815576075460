"""A folded pipeline step (pp > 1) from predicted op times: each rank's chunk forward F, chunk
backward B and co-executed pair c (the pipeline engine runs a pair by the default SI plan's rounds,
``step.plan_pair``; a chunk alone block by block), then the schedule's instruction lists replayed
for every rank (``schedule.simulate.replay``) with a stage-to-stage transfer as latency::

    sequential    the sequential fold (one micro-batch at a time)
    w             the W schedule: F0(k) x B1(k-p) and F1(k) x B0(k-p) pairs
    dualpipev     DualPipeV's order with SI pairs
    ds-dualpipev  DualPipeV's order, each pair run forward then backward (c = F + B): DeepSpeed's
    ds-1f1b       1F1B over p stages of two chunks each, closed form (m + p - 1)(2F + 2B)
                  + 2(p - 1) transfers: Megatron's and DeepSpeed's plain schedule

The replay takes one cost per instruction kind: the slowest chunk's (a pipeline runs at its
slowest stage's pace; rank 0 also holds the embedding and the head). Plain data.
"""

from __future__ import annotations

from ..graph.ops import backward_order
from ..pipe.folding import fold_layers
from ..planning.plan import default_plan
from ..schedule.instructions import Forward, ForwardBackward
from ..schedule.registry import PIPELINE, lookup, names
from ..schedule.simulate import replay
from .costs import StepTimes
from .step import Lap, main_block, plan_pair, specs_of

PEERS = {"ds-1f1b": None, "ds-dualpipev": "dualpipev"}
"""DeepSpeed's pipeline schedules, each with the registry schedule whose order it shares (None: closed form)."""

PIPE_MODES = (*PEERS, *names(PIPELINE, built=True))


def schedule_of(mode: str) -> str | None:
    """The registry schedule a pipeline mode replays (None: ``ds-1f1b``, a closed form)."""
    return PEERS[mode] if mode in PEERS else lookup(mode, PIPELINE).name


def chunk_blocks(num_layers: int, p: int) -> dict[tuple[int, int], list[int]]:
    """(rank, phase) -> its graph blocks in forward order (rank 0: embedding first in phase 0,
    the head last in phase 1)."""
    fold = fold_layers(num_layers, p)
    out = {}
    for r in range(p):
        for phase in (0, 1):
            blocks = [layer + 1 for layer in fold.layers(r, phase)]
            if r == 0:
                blocks = [0] + blocks if phase == 0 else blocks + [num_layers + 1]
            out[(r, phase)] = blocks
    return out


def _alone(st: StepTimes, blocks: list[int], backward: bool) -> Lap:
    """A chunk's forward or backward alone: every op in turn, every collective waited for."""
    ops = [o for b in blocks for o in st.blocks[b]]
    ms = [(o.bwd_ms + o.wgrad_ms if backward else o.fwd_ms, o.comm) for o in ops]
    return Lap(sum(t for t, _ in ms), sum(t for t, comm in ms if comm))


def chunk_costs(st: StepTimes, num_layers: int, p: int) -> dict[str, Lap]:
    """The slowest chunk's forward (``F``), backward (``B``) and pair (``c``), with their waits."""
    chunks = chunk_blocks(num_layers, p)
    main = specs_of(st, main_block(st))
    plan = default_plan(main, backward_order(main))
    worst = {}
    for (r, phase), blocks in chunks.items():
        pair = plan_pair(st, blocks, chunks[(r, 1 - phase)][::-1], plan)
        for key, lap in (("F", _alone(st, blocks, False)), ("B", _alone(st, blocks, True)), ("c", pair)):
            if key not in worst or lap.ms > worst[key].ms:
                worst[key] = lap
    return worst


def pipeline_step(st: StepTimes, mode: str, num_layers: int, p: int, m: int) -> tuple[Lap, float | None]:
    """(the pipelined part of a step of ``mode``, the replay's bubble fraction or None)."""
    k = chunk_costs(st, num_layers, p)
    F, B, c = k["F"], k["B"], k["c"]
    if mode == "ds-1f1b":
        ms = (m + p - 1) * 2 * (F.ms + B.ms) + 2 * (p - 1) * st.p2p_ms
        return Lap(ms, 2 * m * (F.wait_ms + B.wait_ms)), None
    pair = F.ms + B.ms if mode == "ds-dualpipev" else c.ms
    result = replay(lookup(schedule_of(mode), PIPELINE).schedule(p, m), m, F.ms, B.ms, pair, st.p2p_ms)
    if not result.ok:
        raise ValueError(f"{mode}: the schedule replay failed: {result.errors[0]}")
    waits = {"F": F.wait_ms, "B": B.wait_ms, "c": F.wait_ms + B.wait_ms if mode == "ds-dualpipev" else c.wait_ms}
    wait = sum(
        waits[
            "c" if isinstance(ev.instruction, ForwardBackward) else "F" if isinstance(ev.instruction, Forward) else "B"
        ]
        for ev in result.events[0]
    )
    return Lap(result.makespan, wait), result.bubble_fraction
