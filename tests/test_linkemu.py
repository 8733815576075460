"""Link emulation: command shapes, and (where this machine allows) a real shaped 2-rank gloo run."""

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from ds_dhelix.runtime import linkemu
from ds_dhelix.runtime.linkemu import link_emulation_available, run_in_link, wrap_command

AVAILABLE, REASON = link_emulation_available()
needs_link = pytest.mark.skipif(not AVAILABLE, reason=f"link emulation unavailable: {REASON}")


def test_unshaped_command_only_sets_gloo_env():
    cmd = wrap_command(["python", "train.py"], None)
    assert cmd.argv == ["env", "GLOO_SOCKET_IFNAME=lo", "MASTER_ADDR=127.0.0.1", "python", "train.py"]
    assert cmd.warning is None


def test_shaped_command_shape(monkeypatch):
    monkeypatch.setattr(linkemu, "link_emulation_available", lambda: (True, "test"))
    argv, warning = wrap_command(["python", "-c", "print('a b')"], 2, burst_kb=256, latency_ms=50)
    assert warning is None
    assert argv[0] == "unshare" and "-n" in argv[1:3]
    i = argv.index("-c")
    script, dollar0, rest = argv[i + 1], argv[i + 2], argv[i + 3 :]
    assert argv[i - 1] == "sh" and dollar0 == "sh"
    assert rest == ["python", "-c", "print('a b')"]  # passed through "$@": no quoting issues
    assert script.startswith("ip link set lo up && ")
    assert "tc qdisc add dev lo root tbf rate 2gbit burst 256kb latency 50ms" in script
    assert "GLOO_SOCKET_IFNAME=lo" in script and "MASTER_ADDR=127.0.0.1" in script
    assert script.endswith('exec "$@"')


def test_unavailable_returns_command_unchanged_with_warning(monkeypatch):
    monkeypatch.setattr(linkemu, "link_emulation_available", lambda: (False, "not root"))
    argv, warning = wrap_command(["python", "x.py"], 2)
    assert argv == ["python", "x.py"]
    assert "unavailable" in warning and "not root" in warning and "UNSHAPED" in warning


def test_bad_arguments():
    with pytest.raises(ValueError, match="gbps"):
        wrap_command(["true"], 0)
    with pytest.raises(ValueError, match="empty"):
        wrap_command([], 1)


def test_run_unshaped_command():
    proc = run_in_link(
        [sys.executable, "-c", "import os; print(os.environ['GLOO_SOCKET_IFNAME'])"],
        None,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "lo"


def _link_state() -> tuple[str, dict]:
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    env = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")}
    return qdisc.stdout, env


@needs_link
def test_function_runs_behind_shaped_loopback():
    qdisc, env = run_in_link(_link_state, 2, timeout=60)
    assert "tbf" in qdisc and "2Gbit" in qdisc
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    host_qdisc, _ = _link_state()
    assert "tbf" not in host_qdisc  # the host loopback is untouched


def _rank(rank: int, port: int, numel: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}", rank=rank, world_size=2)
    x = torch.full((numel,), float(rank + 1))
    dist.all_reduce(torch.ones(1))  # connect first: time only the big transfer
    t0 = time.perf_counter()
    dist.all_reduce(x)
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{elapsed} {x.min().item()} {x.max().item()}")


def _two_rank_allreduce(numel: int) -> list[tuple[float, float, float]]:
    import torch.multiprocessing as mp

    with socket.socket() as s, tempfile.TemporaryDirectory() as out_dir:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_rank, args=(port, numel, out_dir), nprocs=2, join=True)
        return [tuple(map(float, open(os.path.join(out_dir, f"rank{r}")).read().split())) for r in range(2)]


@pytest.mark.slow
@needs_link
def test_shaped_two_rank_all_reduce():
    numel = 2**20  # 4 MiB fp32
    results = run_in_link(_two_rank_allreduce, 0.1, args=(numel,), timeout=120)
    for elapsed, lo, hi in results:
        assert lo == hi == 3.0  # 1 + 2 on every element
        # Each rank must send at least half the tensor: >= 4 MiB through a 0.1 Gbit/s bucket
        # (minus the burst, DEFAULT_BURST_KB) is >= 0.3 s. Unshaped loopback takes milliseconds.
        assert elapsed > 0.2, results
