"""Activation memory accounting: bytes saved for backward, counted by saved-tensor hooks.

Works on any device. A storage saved by several ops counts once; parameters do not count. The
count drops when autograd releases the saved tensor (after that op's backward).

Also: this process's resident memory (``rss_mib``, ``peak_rss_mib``), and ``release_memory``:
glibc keeps the pages of freed tensors in its heap arenas, so a process that builds one model,
frees it and builds another (the legs of ``dhelix parity``) grows by the first one's size each
time; ``release_memory`` collects garbage and asks glibc to give free pages back (``malloc_trim``;
elsewhere it only collects garbage).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc

import torch


class _Saved:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class _Regathered:
    """A saved view of a ZeRO-3 parameter's gathered copy, kept as its layout only: at unpack the
    same view of the parameter's data, gathered again by then (its block's ``z3.out`` backward), so
    a forward does not keep the gathered copy alive until its backward."""

    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param, t: torch.Tensor):
        self.param, self.size, self.stride, self.offset = param, t.size(), t.stride(), t.storage_offset()

    @property
    def tensor(self) -> torch.Tensor:
        data = self.param.data
        if data.numel() == 0:
            raise RuntimeError(
                f"ZeRO-3 parameter {tuple(getattr(self.param, 'ds_shape', ()))} is not gathered at its op's "
                f"backward: its block's gather did not run (a backward outside the op graph's order)"
            )
        return data.as_strided(self.size, self.stride, self.offset)


class ActivationMeter:
    def __init__(self, params=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        # ZeRO-3: storage of a gathered copy -> its parameter (``engine.zero3``); saved views of them
        # are kept as layouts (``_Regathered``), not counted
        self.gathered: dict = {}
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, refcount]
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, t: torch.Tensor):
        # Keep a detached alias (same storage and version counter, no grad_fn): a tensor an op saves
        # of its own output (tanh, sigmoid, softmax...) would otherwise hold its node through this
        # hook's object, a cycle autograd never frees when a later backward(inputs=...) leaves the
        # node unexecuted (the deferred weight-gradient pass): memory would grow step by step.
        t = t.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.gathered:
            return _Regathered(self.gathered[key], t)
        if key in self.param_storages or storage.nbytes() == 0:
            return _Saved(t, self, None)
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return _Saved(t, self, key)

    def _release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def hold(self, t: torch.Tensor):
        """Count ``t`` as kept for backward (recompute's kept inputs) until the returned handle is
        dropped; a storage already counted counts once."""
        return self._pack(t)

    def hooks(self):
        """Context manager: count tensors saved for backward inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda s: s.tensor)


def null_hooks():
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------ host memory
def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def rss_mib() -> float | None:
    """This process's resident memory now, in MiB (None where /proc is not available)."""
    return _status_mib("VmRSS")


def peak_rss_mib() -> float | None:
    """The peak resident memory since the last :func:`reset_peak_rss` (or the process start)."""
    return _status_mib("VmHWM")


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux ``clear_refs`` 5); False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Collect garbage and return free heap pages to the system (glibc)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
