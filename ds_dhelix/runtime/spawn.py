"""Run a function on N CPU gloo ranks in fresh processes, bounded by a timeout (a hang fails).

    results = run_ranks(fn, world=2, args=(...), timeout=180)

``fn(rank, world, *args)`` runs with the default process group initialized (gloo, one thread per
rank) and returns something picklable; ``run_ranks`` returns the list of per-rank results.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch.multiprocessing as mp

FAILED_PEER_GRACE_S = 30.0
"""How long the other ranks may go on once one has reported an error (they may be waiting on it)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, outdir, args):
    import sys

    os.dup2(2, 1)  # ranks log to stderr: the parent's stdout stays clean for --json output
    sys.stdout = sys.stderr
    from .progress import thread_locked_bars

    thread_locked_bars()  # every tqdm bar of the rank (transformers' too)
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying gloo's worker threads from static destructors can abort
    # ("terminate called without an active exception") after the result is already written.
    os._exit(0)


def _failures(outdir: str, world: int) -> list[tuple[int, str]]:
    """(rank, traceback) of every rank that has already reported an error."""
    failed = []
    for rank in range(world):
        try:
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
        if status != "ok":
            failed.append((rank, value))
    return failed


def run_ranks(fn, world: int, args=(), timeout: float = 180.0):
    outdir = tempfile.mkdtemp(prefix="dhelix-test-")
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), outdir, args), nprocs=world, join=False, start_method="spawn"
    )
    import time

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            failed = _failures(outdir, world)  # one rank's error leaves its peers waiting on it
            if failed:  # they get a grace to fail or finish on their own, not the whole timeout
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    (
                        f"the other ranks did not finish within {FAILED_PEER_GRACE_S:.0f} s of an error"
                        if failed
                        else f"distributed test did not finish within {timeout:.0f} s (hang?)"
                    )
                    + "".join(f"\nrank {r} failed first:\n{tb}" for r, tb in failed)
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results
