"""``dhelix predict --hardware cpu`` against ``dhelix bench`` on this machine: for every link rate
of a bench run, the step time of sequential and SI predicted from an overlap table (``dhelix
profile``, unshaped) against the measured median, and the predicted against the measured speedup.

    python -m benchmarks.predict_check benchmarks/results/predict/tiny-llama-tp2 [--json]
    python -m benchmarks.predict_check --projections benchmarks/results/predict/projections

The folder holds the bench's ``bench.json`` and the table ``table-unshaped.json``; the model and
layout are the bench's own options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODES = ("sequential", "si")


def predict_link(folder: str, options: dict, gbps) -> dict:
    """``dhelix predict``'s result for the bench's model and layout at ``gbps`` (None: unshaped),
    its ops fused or one by one as the table timed them."""
    from ds_dhelix.cli import build_parser
    from ds_dhelix.commands.predict import predict
    from ds_dhelix.planning.planner import OverlapTable

    dp = options.get("data_parallel") or options["ep"]
    table = os.path.join(folder, "table-unshaped.json")
    argv = [
        "predict",
        "--model",
        options["model"],
        "--tp",
        str(options["tp"]),
        "--ep",
        str(options["ep"]),
        "--cp",
        str(options["cp"]),
        "--dp",
        str(dp),
        "--seq-len",
        str(options["seq_len"]),
        "--micro-batch-size",
        str(options["micro_batch_size"]),
        "--micro-batches",
        str(options["micro_batches"]),
        "--zero-stage",
        str(options["zero_stage"]),
        "--hardware",
        "cpu",
        "--table",
        table,
        "--link-gbps",
        "unshaped" if gbps is None else f"{gbps:g}",
        "--schedule",
        *MODES,
        *(() if OverlapTable.load(table).fused else ("--unfused",)),
    ]
    return predict(build_parser().parse_args(argv))


def compare(folder: str) -> list[dict]:
    """One row per link rate: measured and predicted step of each mode, their errors, the speedups."""
    with open(os.path.join(folder, "bench.json"), encoding="utf-8") as fh:
        bench = json.load(fh)
    loads = {str(link["link_gbps"]): link.get("loadavg_1min") for link in bench["links"]}
    rows = []
    for gbps in bench["options"]["link_gbps"]:
        measured = {r["mode"]: r for r in bench["results"] if r["link_gbps"] == gbps and r["status"] == "ok"}
        if not all(m in measured for m in MODES):
            continue
        predicted = predict_link(folder, bench["options"], gbps)["modes"]
        row = {"link_gbps": gbps, "loadavg_1min": loads.get(str(gbps))}
        for m in MODES:
            got, want = measured[m], predicted[m]["step_time_s"]
            row[m] = {
                "measured_s": got["step_time_s"],
                "min_s": got["step_time_min_s"],
                "max_s": got["step_time_max_s"],
                "predicted_s": want,
                "error": want / got["step_time_s"] - 1,
            }
        row["speedup"] = {
            "measured": measured["sequential"]["step_time_s"] / measured["si"]["step_time_s"],
            "predicted": predicted["sequential"]["step_time_s"] / predicted["si"]["step_time_s"],
        }
        row["speedup"]["error"] = row["speedup"]["predicted"] - row["speedup"]["measured"]
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| link | load (1 min) | sequential measured ms [min–max] | predicted | error | si measured ms [min–max] "
        "| predicted | error | speedup measured | predicted | error |\n|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"
    )
    lines = []
    for r in rows:
        link = "unshaped" if r["link_gbps"] is None else f"{r['link_gbps']:g} Gbit/s"
        load = "–" if not r["loadavg_1min"] else " → ".join(f"{x:.1f}" for x in r["loadavg_1min"] if x is not None)
        cells = [link, load]
        for m in MODES:
            x = r[m]
            cells += [
                f"{x['measured_s'] * 1e3:.0f} [{x['min_s'] * 1e3:.0f}–{x['max_s'] * 1e3:.0f}]",
                f"{x['predicted_s'] * 1e3:.0f}",
                f"{x['error'] * 100:+.1f}%",
            ]
        s = r["speedup"]
        cells += [f"{s['measured']:.2f}×", f"{s['predicted']:.2f}×", f"{s['error']:+.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def projection_rows(folder: str) -> str:
    """A markdown table of the ``dhelix predict --json`` files in ``folder`` (one per configuration)."""
    import glob

    head = (
        "| configuration | layout | hardware | baseline s | si (PP: w) s | best SI s (mode) | gain over the best "
        "without SI | intra vs sequential | comm / comp per rank |\n|---|---|---|--:|--:|--:|--:|--:|--:|\n"
    )
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as fh:
            r = json.load(fh)
        m, lay, g, step = r["modes"], r["layout"], r["si_gain"], r["per_step"]
        base_mode = "sequential" if lay["pp"] == 1 else "ds-1f1b"
        base = m[base_mode]
        si = m.get("si") or m.get("w")
        intra = f"{m['sequential']['step_time_s'] / m['intra']['step_time_s']:.2f}×" if "intra" in m else "–"
        layout = f"TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}" + (f" EP{lay['ep']}" if lay["ep"] > 1 else "")
        hw = r["hardware"]
        lines.append(
            f"| {os.path.basename(path)[:-5]} | {layout}, {lay['micro_batches']}×{lay['micro_batch_size']}×"
            f"{lay['seq_len']} | {hw['gpu']['name']} ×{lay['world']}, {hw['nics_per_node']}×"
            f"{hw['network']['name']} | {base['step_time_s']:.2f} ({base_mode}) | {si['step_time_s']:.2f} | "
            f"{m[g['mode']]['step_time_s']:.2f} ({g['mode']}) | {g['speedup']:.2f}× vs {g['baseline']} | "
            f"{intra} | {step['comm_s'] / step['compute_s']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", help="bench folders holding bench.json and table-unshaped.json")
    p.add_argument("--projections", metavar="DIR", help="print the table of the dhelix predict --json files in DIR")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.projections:
        print(projection_rows(args.projections), end="")
    out = {folder: compare(folder) for folder in args.folders}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for folder, rows in out.items():
            print(f"{folder}\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
