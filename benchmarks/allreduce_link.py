"""How much of a gloo all-reduce hides behind compute, on plain loopback and on an emulated link.

For each link (``--gbps none,2``: unshaped, then 2 Gbit/s via ``ds_dhelix.runtime.linkemu``) the whole
Python process tree is re-run inside the link's namespace; two gloo ranks (single-threaded torch)
measure, medians over ``--repeats``:

    comm alone      all_reduce of --size-mib MiB (fp32)
    compute alone   --compute-ms of 512x512 matmuls (the count is calibrated, same on both ranks)
    overlapped      w = all_reduce(async_op=True); compute; w.wait()
    exposed         the part of "overlapped" spent in w.wait() after the compute finished
    comm cpu        CPU time the process (gloo threads included) spends in "comm alone"

    hidden = (comm + compute - overlapped) / comm, clipped to [0, 1]

"hidden" charges the overlapped run for compute slowed down by gloo's threads and the kernel's TCP
work (roughly "comm cpu" when every core already computes); "exposed" does not. On a shared
2-core machine the compute times are noisy: run it more than once.

Usage: ``python benchmarks/allreduce_link.py [--gbps none,2] [--size-mib 32] [--compute-ms 600]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_dhelix.runtime.linkemu import wrap_command  # noqa: E402

WORLD_SIZE = 2
MATMUL_N = 512


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbps", default="none,2", help="comma-separated link rates in Gbit/s; 'none' = unshaped loopback")
    p.add_argument("--size-mib", type=float, default=32.0)
    p.add_argument("--compute-ms", type=float, default=600.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per link run")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size_mib <= 0 or args.compute_ms <= 0 or args.repeats < 1:
        p.error(
            f"--size-mib={args.size_mib}, --compute-ms={args.compute_ms} must be > 0 and --repeats={args.repeats} >= 1"
        )
    return args


# ---- inside the link: two ranks -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fns: list, repeats: int, barrier) -> list[float]:
    """Median time of each function; repetitions are interleaved so drifting load hits all alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            barrier()
            t0 = time.perf_counter()
            fn()
            fn_times.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def _rank_main(rank: int, port: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=WORLD_SIZE)
    buf = torch.zeros(int(cfg["size_mib"] * 2**20) // 4)
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    dist.all_reduce(buf)  # warm-up: connections, buffers

    # Calibrate the matmul count to --compute-ms over ~200 ms of matmuls; all ranks use the largest.
    dist.barrier()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        a @ b
        done += 1
    per_mm_ms = (time.perf_counter() - t0) * 1e3 / done
    count = torch.tensor([max(1, round(cfg["compute_ms"] / per_mm_ms))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    num_matmuls = int(count)

    def compute():
        for _ in range(num_matmuls):
            a @ b

    exposed, comm_cpu = [], []

    def comm():
        t0 = time.process_time()  # all threads of this process: gloo's included
        dist.all_reduce(buf)
        comm_cpu.append((time.process_time() - t0) * 1e3)

    def overlapped():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        t0 = time.perf_counter()
        work.wait()
        exposed.append((time.perf_counter() - t0) * 1e3)

    medians = _median_ms([comm, compute, overlapped], cfg["repeats"], dist.barrier)
    times = torch.tensor([*medians, statistics.median(exposed), statistics.median(comm_cpu)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    if rank == 0:
        comm, comp, both, wait, cpu = times.tolist()
        print(
            "RESULT "
            + json.dumps(
                {
                    "comm_ms": comm,
                    "compute_ms": comp,
                    "overlap_ms": both,
                    "exposed_ms": wait,
                    "comm_cpu_ms": cpu,
                    "num_matmuls": num_matmuls,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def run_inner(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    cfg = {"size_mib": args.size_mib, "compute_ms": args.compute_ms, "repeats": args.repeats}
    mp.spawn(_rank_main, args=(_free_port(), cfg), nprocs=WORLD_SIZE, join=True)


# ---- outside: one run per link, then the table ----------------------------------------------


def run_link(args: argparse.Namespace, gbps: float | None) -> dict:
    inner = [
        sys.executable,
        os.path.abspath(__file__),
        "--inner",
        f"--size-mib={args.size_mib}",
        f"--compute-ms={args.compute_ms}",
        f"--repeats={args.repeats}",
    ]
    cmd = wrap_command(inner, gbps)
    if cmd.warning:
        print(f"WARNING: {cmd.warning}", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd.argv, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"link {gbps} Gbit/s: exit code {proc.returncode}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    comm, comp, both = result["comm_ms"], result["compute_ms"], result["overlap_ms"]
    result["hidden"] = min(1.0, max(0.0, (comm + comp - both) / comm))
    result["shaped"] = gbps is not None and cmd.warning is None
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inner:
        run_inner(args)
        return 0
    try:
        rates = [None if r.strip().lower() == "none" else float(r) for r in args.gbps.split(",")]
    except ValueError:
        raise SystemExit(f"--gbps={args.gbps!r}: expected rates like 'none,2' (Gbit/s)") from None
    print(
        f"all_reduce {args.size_mib:g} MiB fp32, {WORLD_SIZE} gloo ranks, 1 thread each, "
        f"~{args.compute_ms:g} ms compute, median of {args.repeats}"
    )
    print(
        f"{'link':>14} {'comm ms':>8} {'comm cpu':>9} {'compute ms':>11} {'overlap ms':>11} "
        f"{'exposed ms':>11} {'hidden':>7} {'speedup':>8} {'ideal':>6}"
    )
    for gbps in rates:
        r = run_link(args, gbps)
        comm, comp, both = r["comm_ms"], r["compute_ms"], r["overlap_ms"]
        label = "loopback" if gbps is None else f"{gbps:g} Gbit/s" + ("" if r["shaped"] else "*")
        print(
            f"{label:>14} {comm:8.1f} {r['comm_cpu_ms']:9.1f} {comp:11.1f} {both:11.1f} "
            f"{r['exposed_ms']:11.1f} {r['hidden']:7.0%} {(comm + comp) / both:8.2f} "
            f"{(comm + comp) / max(comm, comp):6.2f}",
            flush=True,
        )
        if gbps is not None and not r["shaped"]:
            print("             * link emulation unavailable: this row ran on plain loopback")
    print("speedup = (comm + compute) / overlapped;  ideal = (comm + compute) / max(comm, compute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
