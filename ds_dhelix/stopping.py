"""Clean stops: SIGTERM / SIGINT to any rank, or its launcher going away, become one stop that every
rank agrees on at the next step boundary.

    stop = StopRequest.install()          # in each rank, before training
    for step ...:
        engine.train_batch(data)
        reason = stop.agreed()            # collective: every rank learns whether any rank must stop
        if reason: ... save (optional), exit

A rank's launcher is watched when it is one (``deepspeed``'s runner or ``deepspeed.launcher.launch``,
``torchrun``, ``accelerate launch``): DeepSpeed's single-node runner forwards no signal to the
ranks, so when it is killed the ranks notice that it is gone (within ``poll_s``) and stop. The same
signal again, more than ``REPEAT_S`` after the first, ends the rank at once; another signal right
after the first (Ctrl-C reaches the launcher too, which then sends SIGTERM) is the same stop.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

LAUNCHER_MARKS = ("deepspeed", "torchrun", "torch.distributed.run", "accelerate")
LAUNCHER_GONE = 255  # reason code: the launcher process exited
REPEAT_S = 2.0  # the same signal again after this long ends the rank at once
_REASONS = {int(signal.SIGINT): "SIGINT", int(signal.SIGTERM): "SIGTERM", LAUNCHER_GONE: "the launcher's exit"}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def launcher_pids(pid: int | None = None, depth: int = 3) -> list[int]:
    """The launcher processes among the nearest ``depth`` ancestors of ``pid`` (default: this one)."""
    out, pid = [], _parent(pid or os.getpid())
    for _ in range(depth):
        if not pid or pid <= 1:
            break
        if any(mark in _cmdline(pid) for mark in LAUNCHER_MARKS):
            out.append(pid)
        pid = _parent(pid)
    return out


class StopRequest:
    """This rank's pending stop (a signal code or ``LAUNCHER_GONE``), agreed over the world."""

    def __init__(self, poll_s: float = 1.0):
        self.code, self._first_at = 0, 0.0
        self.poll_s = poll_s
        self.launchers = launcher_pids()
        self._done = threading.Event()

    @classmethod
    def install(cls, poll_s: float = 1.0) -> "StopRequest":
        """Handle SIGTERM / SIGINT and watch the launcher (call from the main thread)."""
        stop = cls(poll_s)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop._on_signal)
        if stop.launchers:
            threading.Thread(target=stop._watch, name="dhelix-launcher-watch", daemon=True).start()
        return stop

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.code == int(signum) and now - self._first_at > REPEAT_S:  # asked again: leave now
            os._exit(128 + signum)
        if not self.code:
            self.code, self._first_at = int(signum), now
        # another signal soon after the first (Ctrl-C reaches the launcher too, which then sends
        # SIGTERM to the ranks) is the same stop: the step still ends, the checkpoint is still saved

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if not all(_alive(pid) for pid in self.launchers):
                self.code = self.code or LAUNCHER_GONE
                return

    def agreed(self) -> str | None:
        """Collective on the default group: the reason any rank must stop (None: go on)."""
        code = torch.tensor([self.code], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        code = int(code)
        if not code:
            return None
        where = "" if code == self.code else " (seen on another rank)"
        return _REASONS.get(code, f"signal {code}") + where

    def exit_code(self) -> int:
        """128 + the signal number (the shell's convention), 143 when the launcher went away."""
        return 128 + (self.code if self.code and self.code != LAUNCHER_GONE else int(signal.SIGTERM))

    def close(self) -> None:
        self._done.set()
