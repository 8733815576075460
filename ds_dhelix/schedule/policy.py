"""The round policy: what runs next when two strands' op lists run together up to a barrier.

One decision function for everything that runs a round: the executor (``runtime.executor``) on
real collectives, ``dhelix predict`` (``predict.retime``) on a virtual clock, and the beam search
that looks for better orders. A ``Round`` holds the two strands' positions and their collectives
in flight; the host that runs it answers the questions only it can (``RoundHost``: has this
collective completed, may it be polled, which weight gradients wait, may this op save its
activations now) and carries out each decision. Strand 0 is the backward strand of a mixed pair
and wins ties; each strand has at most one collective in flight. A decision, in this order::

    FINISH s      (reacting) strand s's collective has completed: finish it, the strand goes on
    LAUNCH s      the head of strand s is a collective and s may go: launch it
    DRAIN         more than ``max_deferred`` weight gradients wait: run the oldest
    COMPUTE s     the next compute op of a strand that may go (``nearest``: the strand with the
                  fewest compute ops before its next collective first, so the link is fed early)
    FILL          both strands wait: run the oldest deferred weight gradient
    WAIT s        wait for strand s's collective (the oldest in flight)
    WAIT_FIRST    (reacting, both in flight) wait for whichever of ``strands`` completes first
    DONE          both lists run and nothing in flight (deferred gradients are the host's to drain)

Who may go: a strand with nothing in flight and ops left, subject to ``gated`` (the forward
strand 1 stays within the backward strand's block depth, and waits while a weight gradient of a
shallower depth is deferred or while its op's saved bytes would lift the live activations over
the budget: ``RoundHost.may_save``) and ``trail`` (two backward strands: strand 1 runs position i
only after strand 0 has run its own, and an op of a weight strand 0 still adds to only after
strand 0's last use of it).

``reacts``: completions are seen as they happen (collectives on separate strand groups, a host
that can poll them); without it a collective is finished only when waited for, the oldest first,
so launch order is a pure function of the op lists. Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

FINISH, LAUNCH, DRAIN, COMPUTE, FILL, WAIT, WAIT_FIRST, DONE = (
    "finish",
    "launch",
    "drain",
    "compute",
    "fill",
    "wait",
    "wait_first",
    "done",
)


@dataclass(frozen=True)
class RoundRules:
    """How a round runs (see the module docstring)."""

    gated: bool = False
    trail: bool = False
    reacts: bool = False
    nearest: bool = True
    max_deferred: int = 2

    def __post_init__(self):
        if self.max_deferred < 0:
            raise ValueError(f"round rules: max_deferred {self.max_deferred} must be >= 0")


class RoundHost(Protocol):
    """What the runner of a round knows that the policy does not."""

    def completed(self, handle: Any) -> bool:
        """Whether the collective ``handle`` (as given to ``Round.launched``) has completed."""

    def pollable(self, item: Any) -> bool:
        """Whether the collective of ``item`` may be polled for completion (else only waited for)."""

    def deferred(self) -> tuple[int, float]:
        """(weight gradients waiting, the oldest one's block depth; infinity when none)."""

    def may_save(self, item: Any) -> bool:
        """Whether forward op ``item`` may save its activations now (the activation budget)."""


@dataclass(frozen=True)
class Decision:
    kind: str
    strand: int = -1
    strands: tuple[int, ...] = ()


_DRAIN, _FILL, _DONE = Decision(DRAIN), Decision(FILL), Decision(DONE)
_FINISH = (Decision(FINISH, 0), Decision(FINISH, 1))
_LAUNCH = (Decision(LAUNCH, 0), Decision(LAUNCH, 1))
_COMPUTE = (Decision(COMPUTE, 0), Decision(COMPUTE, 1))
_WAIT = (Decision(WAIT, 0), Decision(WAIT, 1))


def _next_comm(comm: Sequence[bool]) -> list[int]:
    """Per position: the index of the first collective at or after it (len when none)."""
    out, nxt = [0] * (len(comm) + 1), len(comm)
    out[-1] = nxt
    for i in range(len(comm) - 1, -1, -1):
        if comm[i]:
            nxt = i
        out[i] = nxt
    return out


class Round:
    """Two strands' op lists (strand 0 first; either may be empty) and their collectives in flight.
    ``comm(item)`` / ``depth(item)`` read an item's kind and block depth; ``weights(item)``, needed
    with ``trail`` only, the ids of the parameters its backward adds to."""

    def __init__(
        self,
        strand0: Sequence,
        strand1: Sequence,
        rules: RoundRules,
        *,
        comm: Callable[[Any], bool],
        depth: Callable[[Any], int],
        weights: Callable[[Any], frozenset] | None = None,
    ):
        self.items = (strand0, strand1)
        self.rules = rules
        self.comm = ([comm(x) for x in strand0], [comm(x) for x in strand1])
        self.depth = ([depth(x) for x in strand0], [depth(x) for x in strand1])
        self.next_comm = (_next_comm(self.comm[0]), _next_comm(self.comm[1]))
        self.pos = [0, 0]
        self.flight: list = [None, None]  # per strand: (item, handle) of its collective in flight
        self.order: list[int] = []  # strands with a collective in flight, in launch order
        self.last_use: dict = {}  # trail: parameter id -> last position of strand 0 that adds to it
        self.weights1 = None
        if rules.trail and weights is not None:
            for p, item in enumerate(strand0):
                for pid in weights(item):
                    self.last_use[pid] = p
            self.weights1 = [weights(x) for x in strand1]

    # ---- state the host changes
    def take(self, s: int):
        """The head of strand s, which the host now runs (a compute op) or launches (a collective)."""
        item = self.items[s][self.pos[s]]
        self.pos[s] += 1
        return item

    def launched(self, s: int, item, handle) -> None:
        self.flight[s] = (item, handle)
        self.order.append(s)

    def finished(self, s: int):
        """Strand s's collective is done; returns its (item, handle)."""
        done, self.flight[s] = self.flight[s], None
        self.order.remove(s)
        return done

    def copy(self, copy_handle: Callable[[Any], Any]) -> Round:
        """A copy whose positions and flights change independently (the beam search's states)."""
        c = object.__new__(Round)
        c.__dict__.update(self.__dict__)
        c.pos, c.order = list(self.pos), list(self.order)
        c.flight = [None if f is None else (f[0], copy_handle(f[1])) for f in self.flight]
        return c

    # ---- queries
    def left(self, s: int) -> int:
        return len(self.items[s]) - self.pos[s]

    def head(self, s: int):
        return self.items[s][self.pos[s]]

    def until_comm(self, s: int) -> int:
        """Compute ops ahead of strand s's next collective."""
        return self.next_comm[s][self.pos[s]] - self.pos[s]

    @property
    def done(self) -> bool:
        return not (self.left(0) or self.left(1) or self.order)

    def may_go(self, s: int, host: RoundHost) -> bool:
        if self.flight[s] is not None or self.pos[s] >= len(self.items[s]):
            return False
        if self.rules.trail and s == 1 and self.left(0):
            return self._trail_open()
        if s == 0 or not self.rules.gated:
            return True
        return self._gate_open(host)

    def _trail_open(self) -> bool:
        done0 = self.pos[0]
        if self.pos[1] >= done0:
            return False
        if self.weights1 is None:
            return True
        return all(self.last_use.get(pid, -1) < done0 for pid in self.weights1[self.pos[1]])

    def _gate_open(self, host: RoundHost) -> bool:
        f_depth = self.depth[1][self.pos[1]]
        num, oldest = host.deferred()
        if num and oldest < f_depth:
            return False
        if self.flight[0] is None and not self.left(0):
            return True
        b_depth = self.depth[0][self.pos[0] - 1] if self.flight[0] is not None else self.depth[0][self.pos[0]]
        return f_depth <= b_depth and host.may_save(self.head(1))

    # ---- decisions
    def _finishing(self, host: RoundHost) -> Decision | None:
        if self.rules.reacts:
            for s in self.order:
                if host.completed(self.flight[s][1]):
                    return _FINISH[s]
        return None

    def _goers(self, host: RoundHost) -> tuple[bool, bool]:
        return self.may_go(0, host), self.may_go(1, host)

    def _launch(self, go: tuple[bool, bool]) -> Decision | None:
        for s in (0, 1):
            if go[s] and self.comm[s][self.pos[s]]:
                return _LAUNCH[s]
        return None

    def forced(self, host: RoundHost) -> Decision | None:
        """FINISH or LAUNCH when one is due (they are never a choice), else None."""
        return self._finishing(host) or self._launch(self._goers(host))

    def choices(self, host: RoundHost, go: tuple[bool, bool] | None = None) -> list[Decision]:
        """Every legal next step once nothing is forced (``go``: ``may_go`` of each strand, if known):
        DRAIN alone when too many weight gradients wait; else COMPUTE per strand that may go, FILL
        when a weight gradient waits; else a wait."""
        num, _ = host.deferred()
        if num > self.rules.max_deferred:
            return [_DRAIN]
        go = self._goers(host) if go is None else go
        out = [_COMPUTE[s] for s in (0, 1) if go[s]]
        if num:
            out.append(_FILL)
        if out:
            return out
        if not self.order:
            raise RuntimeError(f"round stuck at positions {self.pos}: no strand may go and nothing in flight")
        return [self.wait(host)]

    def wait(self, host: RoundHost) -> Decision:
        """Which collective to wait for: the oldest, or (reacting, both in flight) whichever of the
        pollable ones completes first. Blocking on one strand's collective would tie the other
        strand to the first one's peers: ranks open the forward gate by their own progress and
        live bytes, so a rank may have launched a forward collective its peer holds back while that
        peer's backward strand waits for the rank's next backward collective."""
        if self.rules.reacts and len(self.order) > 1:
            polled = tuple(s for s in self.order if host.pollable(self.flight[s][0]))
            if polled:
                return Decision(WAIT_FIRST, strands=polled)
        return _WAIT[self.order[0]]

    def decide(self, host: RoundHost) -> Decision:
        """The policy's next step: forced moves first, then the rule's pick among ``choices``
        (compute before fill before wait; between two strands, ``nearest`` or strand 0)."""
        if self.done:
            return _DONE
        finishing = self._finishing(host)
        if finishing is not None:
            return finishing
        go = self._goers(host)
        launch = self._launch(go)
        if launch is not None:
            return launch
        options = self.choices(host, go)
        if (
            len(options) > 1
            and options[1].kind == COMPUTE
            and self.rules.nearest
            and self.until_comm(1) < self.until_comm(0)
        ):
            return options[1]
        return options[0]
