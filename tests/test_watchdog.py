"""Hang watchdog: fires in a stuck process (exit 3, names the position), quiet while beating."""

import subprocess
import sys
import textwrap
import time

import pytest

from ds_dhelix.runtime.watchdog import EXIT_CODE, Watchdog


def _run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = "import time\nfrom ds_dhelix.runtime.watchdog import Watchdog\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


def test_fires_when_stuck():
    t0 = time.monotonic()
    proc = _run("""
        def stuck_in_collective():
            time.sleep(30)

        with Watchdog(0.5, rank=1, describe_fn=lambda: "pending: attn.rs on comm:tp") as wd:
            wd.beat(step=7, microbatch=3, strand="beta", op="moe.dispatch")
            stuck_in_collective()
        """)
    assert proc.returncode == EXIT_CODE == 3, proc.stderr
    assert time.monotonic() - t0 < 20
    first = proc.stderr.splitlines()[0]
    assert first.startswith("[dhelix watchdog] rank 1 stuck for ")
    assert first.endswith("at step 7, micro-batch 3, strand beta, op moe.dispatch")
    assert "pending: attn.rs on comm:tp" in proc.stderr
    assert "stuck_in_collective" in proc.stderr  # the watched thread's stack


def test_quiet_while_beating_and_after_stop():
    proc = _run("""
        wd = Watchdog(0.5, rank=0).start()
        for i in range(40):
            wd.beat(step=i, op="attn.qkv")
            time.sleep(0.05)
        wd.stop()
        time.sleep(1.0)  # disarmed: a long pause is fine now
        print("done")
        """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done" and "watchdog" not in proc.stderr


def test_partial_beats_keep_position_and_report():
    wd = Watchdog(10, rank=2, describe_fn=lambda: 1 / 0)
    wd.beat(step=4)
    wd.beat(microbatch=1, strand="alpha", op="mlp.fc2")
    text = wd.report(12.34)
    assert text.startswith(
        "[dhelix watchdog] rank 2 stuck for 12.3s at step 4, micro-batch 1, strand alpha, op mlp.fc2\n"
    )
    assert "describe_fn failed" in text
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(0, rank=0)


def _one_rank_fails(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 0:
        raise RuntimeError("rank zero broke first")
    dist.recv(torch.zeros(1), src=0)  # waits for a peer that will never send


@pytest.mark.timeout(120)
def test_world_timeout_shows_the_rank_that_failed_first():
    """A rank's error leaves its peers waiting on it: the timeout says which rank failed, and how."""
    from tests.conftest import run_ranks

    with pytest.raises(TimeoutError) as err:
        run_ranks(_one_rank_fails, 2, timeout=20)
    assert "rank 0 failed first" in str(err.value) and "rank zero broke first" in str(err.value)


@pytest.mark.timeout(120)
def test_a_rank_error_ends_the_world_after_a_grace_not_the_timeout(monkeypatch):
    """Peers stuck on a failed rank do not hold the world for the whole timeout."""
    import time

    from ds_dhelix.runtime import spawn

    monkeypatch.setattr(spawn, "FAILED_PEER_GRACE_S", 3.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        spawn.run_ranks(_one_rank_fails, 2, timeout=600)
    assert time.monotonic() - t0 < 90, "waited for the timeout instead of the grace"
    assert str(err.value).startswith("the other ranks did not finish within 3 s of an error")
    assert "rank zero broke first" in str(err.value)


def test_collective_failures_names_deepspeeds_own_collectives():
    # a backend error inside DeepSpeed's reduction / optimizer step reads like the executor's own
    from ds_dhelix.runtime.comm import CollectiveError, collective_failures

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28572: "
        "Connection reset by peer. This is typically caused by a remote worker hanging"
    )
    with pytest.raises(CollectiveError) as info:
        with collective_failures("of the gradient reduction and optimizer step"):
            raise gloo
    assert str(info.value) == (
        "collective of the gradient reduction and optimizer step failed "
        "(peer 127.0.0.1:28572): Read error [127.0.0.1]:28572: Connection reset by peer"
    )
    assert info.value.__cause__ is gloo
    with pytest.raises(CollectiveError, match="^collective during optimizer step failed"):
        with collective_failures(lambda: "during optimizer step"):  # a position read when it fails
            raise gloo
    ours = CollectiveError("attn.ag (F strand, micro-batch 0, block 1)", gloo)
    with pytest.raises(CollectiveError) as info:  # already named: left as it is
        with collective_failures("of the optimizer step"):
            raise ours
    assert info.value is ours
    with pytest.raises(RuntimeError, match="shape mismatch") as info:  # not a backend failure
        with collective_failures("of the optimizer step"):
            raise RuntimeError("shape mismatch")
    assert not isinstance(info.value, CollectiveError)
