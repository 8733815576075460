"""``dhelix convert-checkpoint``: a training checkpoint as a layout-free one, offline, in one process.

    dhelix convert-checkpoint ckpt --out ckpt-any-layout
    deepspeed --num_gpus 4 train.py ... --resume ckpt-any-layout --allow-resume-change

Reads a ``--ds-checkpoint`` directory (its ``latest`` tag, or ``--tag``) written at any TP / PP / DP /
EP / ZeRO stage and writes ``OUT/<tag>/universal/``: every trained parameter's fp32 master and
optimizer moments as full HF tensors (safetensors), the optimizer step, the step counters and the
LR scheduler, with the run state and ``latest`` beside them. ``--resume OUT`` continues from it on
any layout with the same global batch; each rank reads only its shards. A resume on another
layout converts by itself (into the checkpoint's own tag); this command does it ahead of time or
on a machine without the training's devices.
"""

from __future__ import annotations

import json
import os
import shutil

from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "convert-checkpoint",
        help="a training checkpoint as one that resumes on any TP/DP/EP/ZeRO layout (offline)",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsFormatter,
    )
    p.add_argument("checkpoint", help="a --ds-checkpoint directory, or one of its tags")
    p.add_argument("--out", required=True, help="where the converted checkpoint goes (a new or empty directory)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ds_dhelix.engine.reshard import UNIVERSAL, to_universal
    from ds_dhelix.engine.resume import RUN_STATE_FILE, locate, read_run_state
    from ds_dhelix.runtime.progress import progress

    root, tag = locate(args.checkpoint, flag="checkpoint")
    state = read_run_state(root, tag)
    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out!r} exists and is not an empty directory; choose a new path")
    if os.path.commonpath([out, root]) == root:
        raise ValueError(f"--out {out!r} lies inside the checkpoint {root!r}; choose a path outside it")
    tag_dir = os.path.join(out, tag)
    os.makedirs(tag_dir)
    try:
        bar = progress(total=1, desc="convert", unit="tensor")

        def tick(done, total, what):
            bar.total = total
            bar.update(done - bar.n)

        folder = to_universal(root, tag, tag_dir, progress=tick)
        bar.close()
        shutil.copy(os.path.join(root, tag, RUN_STATE_FILE), os.path.join(tag_dir, RUN_STATE_FILE))
        with open(os.path.join(out, "latest"), "w") as f:
            f.write(tag)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    summary = {
        "source": os.path.join(root, tag),
        "out": tag_dir,
        "step": state["step"],
        "layout": state.get("layout"),
        "bytes": size,
        "folder": UNIVERSAL,
    }
    if args.json:
        print(json.dumps(summary), file=args.stdout)
    else:
        print(
            f"dhelix convert-checkpoint: {summary['source']} (step {state['step']}) -> {tag_dir} "
            f"({size / 2**20:.1f} MiB); resume it with --resume {out} --allow-resume-change",
            file=args.stdout,
        )
    return 0
