"""Benchmark outputs: ``bench.json`` (everything), ``bench.csv`` (the rows), ``bench.md`` (the
table) and ``bench.png`` (tokens/s against link rate, one line per mode)."""

from __future__ import annotations

import csv
import io
import json
import math
import os

from ds_dhelix.planning.plan import write_atomic

from .options import MIN_REPEATS

CSV_COLUMNS = (
    "mode",
    "link_gbps",
    "link",
    "shaped",
    "status",
    "steps",
    "step_time_s",
    "tokens_per_s",
    "speedup_vs_sequential",
    "ideal_speedup",
    "achieved_over_ideal",
    "step_bound_speedup",
    "cpu_bound_speedup",
    "cpu_bound_over_ideal",
    "compute_s",
    "comm_s",
    "exposed_comm_s",
    "dp_reduce_s",
    "dp_exposed_s",
    "hidden_of_hideable",
    "hidden_of_comm",
    "peak_activation_bytes",
    "peak_gathered_bytes",
    "mfu",
    "cpu_s",
    "other_threads_cpu_s",
    "step_time_min_s",
    "step_time_max_s",
    "build_s",
    "plan_source",
    "plan_is_default",
    "plan_fingerprint",
    "reason",
)


def _times(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def _peak(r: dict) -> str:
    """The activation peak (MiB); under ZeRO-3 with the op graph, ``+ N gathered``: the most
    parameter MiB gathered at once (plain DeepSpeed's saved gathered weights count as activations)."""
    act = _fmt(None if r["peak_activation_bytes"] is None else r["peak_activation_bytes"] / 2**20, ".1f")
    gathered = r.get("peak_gathered_bytes")
    return act if gathered is None else f"{act} + {gathered / 2**20:.1f} gathered"


def markdown_table(report: dict) -> str:
    """The rows as a markdown table, one block per link rate, plus the comm/comp ratio line."""
    lines = [
        "| link | mode | step ms [min–max] | tokens/s | vs seq | ideal | achieved/ideal | CPU bound | comp ms | "
        "comm ms | exposed ms | hidden | DP reduce / exposed ms | comm-thread CPU ms | peak act MiB |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in report["results"]:
        link = r["link"] + ("" if r["shaped"] or r["link_gbps"] is None else " (UNSHAPED)")
        if r["status"] != "ok":
            lines.append(
                f"| {link} | {r['mode']} | {r['status']}: {r.get('reason') or ''} |  |  |  |  |  |  |  |  |  |  |  |  |"
            )
            continue
        ms = lambda v: _fmt(v * 1e3 if v is not None else None, ".0f")  # noqa: E731
        step = f"{ms(r['step_time_s'])} [{ms(r.get('step_time_min_s'))}–{ms(r.get('step_time_max_s'))}]"
        dp = "–" if r.get("dp_reduce_s") is None else f"{ms(r['dp_reduce_s'])} / {ms(r['dp_exposed_s'])}"
        if r.get("repeats_below_minimum"):
            step += f" (n={r['steps']} < {MIN_REPEATS})"
        lines.append(
            f"| {link} | {r['mode']} | {step} | {_fmt(r['tokens_per_s'], '.0f')} | "
            f"{_times(r['speedup_vs_sequential'])} | {_times(r['ideal_speedup'])} | "
            f"{_fmt(r['achieved_over_ideal'], '.2f')} | {_times(r.get('cpu_bound_speedup'))} | "
            f"{ms(r['compute_s'])} | {ms(r['comm_s'])} | "
            f"{ms(r['exposed_comm_s'])} | {_fmt(r['hidden_of_hideable'], '.0%')} | {dp} | "
            f"{ms(r.get('other_threads_cpu_s'))} | "
            f"{_peak(r)} |"
        )
    ratio = report.get("comm_comp_ratio") or {}
    if ratio.get("value") is not None:
        lines.append("")
        lines.append(
            f"comm/comp of the sequential run at {ratio['link']}: {ratio['value']:.2f} "
            f"(per link: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio["by_link"].items()) + ")"
        )
    ceilings = [
        f"{r['mode']} at {r['link']} {r['cpu_bound_over_ideal']:.2f}"
        for r in report["results"]
        if r.get("cpu_bound_over_ideal") is not None
    ]
    if ceilings:
        lines.append("")
        lines.append("highest achieved/ideal these CPU cores allow (CPU bound / ideal): " + ", ".join(ceilings))
    return "\n".join(lines) + "\n"


def rows_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k) for k in CSV_COLUMNS})
    return buf.getvalue()


def plot_throughput(rows: list[dict], path: str, title: str) -> str | None:
    """tokens/s against link rate per mode (unshaped drawn at the right end); None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rates = sorted({r["link_gbps"] for r in rows if r["link_gbps"] is not None})
    xs = {g: i for i, g in enumerate(rates)}
    if any(r["link_gbps"] is None for r in rows):
        xs[None] = len(rates)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((xs[r["link_gbps"]], r["tokens_per_s"]) for r in rows if r["mode"] == mode and r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    ax.set_xticks(list(xs.values()), [f"{g:g}" if g is not None else "unshaped" for g in xs])
    ax.set_xlabel("link (Gbit/s, emulated)")
    ax.set_ylabel("tokens / s (median step)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(report: dict, out_dir: str, stem: str = "bench") -> dict:
    """Write the four files; return their paths by kind."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for kind, text in (("json", dumps(report)), ("csv", rows_csv(report["results"])), ("md", markdown_table(report))):
        paths[kind] = os.path.join(out_dir, f"{stem}.{kind}")
        write_atomic(paths[kind], text)
    png = plot_throughput(report["results"], os.path.join(out_dir, f"{stem}.png"), report.get("title", ""))
    if png:
        paths["png"] = png
    return paths


def dumps(report: dict) -> str:
    return json.dumps(report, indent=1)
