"""Clean stops: SIGTERM / SIGINT to any rank, or its launcher going away, become one stop that every
rank agrees on at the next step boundary.

    stop = StopRequest.install()          # in each rank, before training
    for step ...:
        engine.train_batch(data)
        reason = stop.agreed()            # collective: every rank learns whether any rank must stop
        if reason: ... save (optional), exit
    stop.close()                          # the default handlers again

A rank's launcher is watched when it is one (``deepspeed``'s runner or ``deepspeed.launcher.launch``,
``torchrun``, ``accelerate launch``): DeepSpeed's single-node runner forwards no signal to the
ranks, so when it is killed the ranks notice that it is gone (within ``poll_s``) and stop.

Signals are read by a watcher thread through ``signal.set_wakeup_fd``, so they are seen even while
the main thread waits inside a collective (where Python runs no signal handler). The same signal
again, more than ``REPEAT_S`` after the first, ends the rank at once; another signal right after
the first (Ctrl-C reaches the launcher too, which then sends SIGTERM to the ranks) is the same stop.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

LAUNCHER_GONE = 255  # reason code: the launcher process exited
REPEAT_S = 2.0  # the same signal again after this long ends the rank at once
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_REASONS = {int(signal.SIGINT): "SIGINT", int(signal.SIGTERM): "SIGTERM", LAUNCHER_GONE: "the launcher's exit"}


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def is_launcher(argv: list[str]) -> bool:
    """A launcher's command line: the ``deepspeed`` / ``torchrun`` / ``accelerate`` script, or
    ``python -m`` of DeepSpeed's or torch's launch module (the first three words decide)."""
    head = [os.path.basename(a) for a in argv[:3]]
    modules = {
        "deepspeed.launcher.launch",
        "deepspeed.launcher.runner",
        "torch.distributed.run",
        "torch.distributed.launch",
    }
    return bool({"deepspeed", "torchrun", "accelerate"} & set(head)) or bool(modules & set(argv[:3]))


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
        if is_launcher(_argv(pid)):
            out.append(pid)
        pid = _parent(pid)
    return out


class StopRequest:
    """This rank's pending stop (a signal number or ``LAUNCHER_GONE``), agreed over the world."""

    def __init__(self, poll_s: float = 1.0):
        self.code, self._first_at = 0, 0.0
        self.poll_s = poll_s
        self.launchers = launcher_pids()
        self._done = threading.Event()
        self._saved: dict = {}
        self._wakeup = None

    @classmethod
    def install(cls, poll_s: float = 1.0) -> StopRequest:
        """Handle SIGTERM / SIGINT and watch the launcher (call from the main thread)."""
        stop = cls(poll_s)
        read, write = os.pipe()
        os.set_blocking(write, False)
        stop._wakeup = (read, write, signal.set_wakeup_fd(write))
        for sig in SIGNALS:
            stop._saved[sig] = signal.signal(sig, lambda signum, frame: None)  # the watcher reads them
        threading.Thread(target=stop._read_signals, name="dhelix-signals", daemon=True).start()
        if stop.launchers:
            threading.Thread(target=stop._watch, name="dhelix-launcher-watch", daemon=True).start()
        return stop

    def note(self, signum: int) -> None:
        """Record a signal (the first one decides the reason); the same one again, later, leaves now."""
        now = time.monotonic()
        if self.code == signum and now - self._first_at > REPEAT_S:
            os._exit(128 + signum)
        if not self.code:
            self.code, self._first_at = signum, now

    def _read_signals(self) -> None:
        read = self._wakeup[0]
        while not self._done.is_set():
            try:
                data = os.read(read, 64)
            except OSError:
                return
            for signum in data:
                if signum in (int(s) for s in SIGNALS):
                    self.note(signum)

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if not all(_alive(pid) for pid in self.launchers):
                if not self.code:
                    self.code = LAUNCHER_GONE
                return

    def agreed(self) -> str | None:
        """Collective on the default group: the reason any rank must stop (None: go on)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return _REASONS.get(self.code, f"signal {self.code}") if self.code else None
        from deepspeed.accelerator import get_accelerator

        code = torch.tensor([self.code], dtype=torch.int64, device=get_accelerator().current_device_name())
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        code = int(code.item())
        if not code:
            return None
        where = "" if code == self.code else " (seen on another rank)"
        return _REASONS.get(code, f"signal {code}") + where

    def exit_code(self) -> int:
        """128 + the signal number (the shell's convention), 143 when the launcher went away."""
        return 128 + (self.code if self.code and self.code != LAUNCHER_GONE else int(signal.SIGTERM))

    def close(self) -> None:
        """Stop watching and put the previous signal handling back."""
        self._done.set()
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)
            os.close(read)
            self._wakeup = None
