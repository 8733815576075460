"""Hang watchdog: if the training loop stops beating, say where it stopped and exit.

    wd = Watchdog(timeout_s=300, rank=rank)
    with wd:                                   # starts the watcher thread; stop() on exit
        for step ...:
            wd.beat(step=step, microbatch=m, strand="F", op="attn.rs")
            ...

With no beat for ``timeout_s`` seconds the watcher prints to stderr::

    [dhelix watchdog] rank 1 stuck for 300.2s at step 7, micro-batch 3, strand B, op moe.dispatch

followed by ``describe_fn()`` (if given) and the stack of the thread that called ``start`` (the
training loop, normally the main thread), then ends the process with
``os._exit(3)`` so a launcher sees the failure instead of waiting forever. A beat costs one
``time.monotonic()`` and a few attribute stores. The watcher is a Python thread: it runs
while the training thread waits in a collective (those release the GIL), not while C code holds it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

EXIT_CODE = 3
STACK_FRAMES = 12
_monotonic = time.monotonic


class Watchdog:
    """Exit with code 3 and a position report when ``beat`` is not called for ``timeout_s``.

    ``describe_fn() -> str`` adds context to the report (e.g. pending collectives); it is called
    only when the watchdog fires, and a failure inside it is reported, not raised.
    """

    def __init__(self, timeout_s: float, rank: int, describe_fn: Callable[[], str] | None = None):
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s={timeout_s!r} must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.describe_fn = describe_fn
        # The last position: plain attributes, so a beat is a clock read and a few stores.
        self.last_time = _monotonic()
        self.step = self.microbatch = self.strand = self.op = None
        self.paused = False  # between training steps: user code may legitimately take long
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched = threading.main_thread()

    def beat(self, step=None, microbatch=None, strand=None, op=None) -> None:
        """Record progress at this position (fields left as None keep their last value)."""
        self.last_time = _monotonic()
        if step is not None:
            self.step = step
        if microbatch is not None:
            self.microbatch = microbatch
        if strand is not None:
            self.strand = strand
        if op is not None:
            self.op = op

    def pause(self) -> None:
        """Stop counting until the next ``resume()`` (e.g. between training steps)."""
        self.paused = True

    def resume(self, **where) -> None:
        """Count again from now (``where``: as for ``beat``)."""
        self.beat(**where)
        self.paused = False

    def start(self) -> Watchdog:
        """Arm the watchdog; the timeout counts from now."""
        if self._thread is not None:
            return self
        self.last_time = _monotonic()
        self._watched = threading.current_thread()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name=f"dhelix-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Disarm the watchdog (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while True:
            idle = _monotonic() - self.last_time
            if self._stop.wait(max(self.timeout_s - idle, 0.0) + 0.01):
                return
            idle = _monotonic() - self.last_time
            if idle >= self.timeout_s and not self.paused:
                self._fire(idle)

    def report(self, idle: float) -> str:
        """The text printed when the watchdog fires."""
        show = lambda v: "?" if v is None else v  # noqa: E731
        lines = [
            f"[dhelix watchdog] rank {self.rank} stuck for {idle:.1f}s at step "
            f"{show(self.step)}, micro-batch {show(self.microbatch)}, "
            f"strand {show(self.strand)}, op {show(self.op)}"
        ]
        if self.describe_fn is not None:
            try:
                lines.append(str(self.describe_fn()))
            except Exception as err:  # the report must come out even if the hook is broken
                lines.append(f"(describe_fn failed: {err!r})")
        frame = sys._current_frames().get(self._watched.ident)
        if frame is not None:
            lines.append(f"stack of thread {self._watched.name!r} (most recent call last):")
            lines.extend(s.rstrip("\n") for s in traceback.format_stack(frame)[-STACK_FRAMES:])
        return "\n".join(lines) + "\n"

    def _fire(self, idle: float) -> None:
        try:
            text = self.report(idle)
        except Exception as err:
            text = f"[dhelix watchdog] rank {self.rank} stuck for {idle:.1f}s ({err!r})\n"
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:
            os.write(2, text.encode(errors="replace"))
        os._exit(EXIT_CODE)
