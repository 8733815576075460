"""The run's summary: step losses and timings, communication hidden, the data's figures, eval
losses, the probe loss the HF export must reproduce and every rank's host memory; printed on rank
0 and written as JSON (train.py's ``--json-summary``).

    probe = probe_loss(engine, data)                 collective (before the export)
    memory = memory_marks(engine, marks)             collective
    if rank == 0: summarize(log, engine, data, options, model=..., probe=probe, memory=memory)
"""

from __future__ import annotations

import json
import statistics

from .loop import LoopOptions, TrainLog, loss_average


def probe_loss(engine, data, micro: int | None = None) -> dict:
    """Loss of the trained model on the first ``micro`` blocks of the data (their ids and labels,
    no positions or masks): the exported HF checkpoint must reproduce it (the end-to-end test
    checks that). Another objective: its loss on the first rows (with their objective columns:
    reference log-probabilities, advantages). Collective."""
    import torch

    from ds_dhelix.engine.evaluation import is_dhelix

    first = data.first_batch(micro or engine.train_micro_batch_size_per_gpu())
    block = first["input_ids"]
    batch = {"input_ids": block, "labels": first["labels"]}
    from ds_dhelix.graph.objectives import ROW_KEYS, TOKEN_KEYS

    batch.update({k: first[k] for k in (*ROW_KEYS, *TOKEN_KEYS) if k in first})  # an objective's columns
    if is_dhelix(engine):
        loss = engine.eval_batch(iter([batch] * engine.gradient_accumulation_steps()))
    else:
        engine.eval()
        with torch.no_grad():
            loss = engine(**batch).loss
        engine.train()
    return {"probe_input_ids": block.tolist(), "probe_labels": first["labels"].tolist(), "probe_loss": float(loss)}


def memory_marks(engine, marks: dict | None = None) -> list[dict]:
    """Every rank's host memory marks (collective): ``marks`` (baseline, load peak, shard; train.py
    measures them around the build), the training peak; and under ds_dhelix its optimizer's state
    bytes and its trainable / all parameter counts."""
    import torch.distributed as dist

    from ds_dhelix.runtime.memory import peak_rss_mib

    mine = {
        "rank": dist.get_rank(),
        **(marks or {}),
        "train_peak_rss_mib": peak_rss_mib(),
        **(
            {
                "optimizer_state_bytes": engine.optimizer_state_bytes(),
                "optimizer": type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
                "trainable_parameters": sum(_numel(p) for p in engine.module.parameters() if p.requires_grad),
                "parameters": sum(_numel(p) for p in engine.module.parameters()),
                # what the rank holds: under ZeRO-3 its partitions (1/DP of each parameter)
                "held_parameters": sum(
                    p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters()
                ),
            }
            if hasattr(engine, "optimizer_state_bytes")
            else {}
        ),
    }
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _numel(p) -> int:
    """A parameter's elements on this rank's model (its TP shard), a ZeRO-3 partitioned one's too."""
    return getattr(p, "ds_numel", p.numel())


def summarize(
    log: TrainLog,
    engine,
    data,
    options: LoopOptions,
    *,
    model: str,
    attn_implementation: str | None = None,
    export: str | None = None,
    export_label: str = "HF checkpoint",
    probe: dict | None = None,
    memory: list[dict] | None = None,
    json_path: str | None = None,
) -> dict:
    """Print the run's summary and return it (written to ``json_path`` too): call on rank 0.
    ``export``: the HF checkpoint (or adapter: ``export_label``) written, None when there is none;
    ``probe``, ``memory``: ``probe_loss``'s and ``memory_marks``' results."""
    losses, times, stats = log.losses, log.times, log.stats
    k = max(1, len(losses) // 10)
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    med = statistics.median(times[1:] or times)
    tokens, average = log.tokens_per_step, loss_average(options.loss_average, data)
    summary = {"model": model, "attn_implementation": attn_implementation, "start_step": log.start_step,
               "steps": len(losses), "total_steps": options.steps, "loss_first": first, "loss_last": last,
               "losses": losses, "lrs": log.lrs, "median_step_s": med, "tokens_per_s": tokens / med,
               "hf_checkpoint": export, "eval_losses": log.eval_losses,
               "data": {**data.summary(), "loss_average": average}}  # fmt: skip
    line = (
        f"done: steps {log.start_step + 1}-{log.start_step + len(losses)}, loss {first:.3f} -> {last:.3f}, "
        f"median step {med * 1e3:.0f} ms, {tokens / med:.0f} tokens/s"
    )
    if stats:
        figures, text = _schedule_figures(stats, engine.dhelix.schedule)
        summary.update(figures)
        line += text
    print(line)
    _print_objective(log.objective, engine, summary)
    _print_data(data.summary(), average)
    if log.eval_losses:
        print("eval loss: " + ", ".join(f"step {e['step']} {e['loss']:.4f}" for e in log.eval_losses))
    _print_auto(engine, summary)
    if export:
        print(f"{export_label}: {export}")
    summary.update(probe or {})
    summary["memory"] = memory
    _print_memory(memory)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


SHOWN = (
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "kl",
    "clip_ratio/region",
    "advantages",
    "completions/length",
)
"""An objective's metrics the summary line shows (its first four of these)."""


def _print_objective(metrics: list[dict], engine, summary: dict) -> None:
    """A preference objective's rewards, first -> last step (means over a tenth of the steps, as
    the loss), in the line and ``summary["objective"]`` (its per-step metrics too)."""
    if not metrics:
        return
    k = max(1, len(metrics) // 10)
    first = {n: statistics.mean(m[n] for m in metrics[:k]) for n in metrics[0]}
    last = {n: statistics.mean(m[n] for m in metrics[-k:]) for n in metrics[0]}
    summary["objective"] = {"name": engine.dhelix.objective.name, "first": first, "last": last, "steps": metrics}
    shown = [n for n in SHOWN if n in first][:4]
    print(f"{engine.dhelix.objective.name}: " + ", ".join(f"{n} {first[n]:.3f} -> {last[n]:.3f}" for n in shown))


def _print_auto(engine, summary: dict) -> None:
    """``"schedule": "auto"``: what it chose, from which figures (also in ``summary``)."""
    auto = getattr(engine, "auto", None)
    if auto is None:
        return
    from ds_dhelix.planning.autoschedule import describe

    summary["auto_decisions"] = auto.decisions
    print(
        "\n".join(describe(d) for d in auto.decisions)
        if auto.decisions
        else f"ds_dhelix: schedule auto still timing its candidates ({auto.trial_steps_left} trial steps left)"
    )


def _schedule_figures(stats: list, schedule: str) -> tuple[dict, str]:
    """The summary's communication figures per step (the first step left out when there are
    more) and the summary line's tail."""
    kept = stats[1:] or stats
    comm = sum(s.comm_and_exposed[0] for s in kept)  # CUDA: from CUDA events
    exposed = sum(s.comm_and_exposed[1] for s in kept)
    frac = max(0.0, 1 - exposed / comm) if comm > 0 else 0.0
    n = len(kept)
    figures = dict(
        schedule=schedule,
        comm_ms_per_step=comm / n * 1e3,
        exposed_comm_ms_per_step=exposed / n * 1e3,
        hidden_fraction=frac,
        peak_activation_bytes=max(s.peak_activation_bytes for s in stats),
    )
    launches = sum(s.launches for s in kept)
    if launches:  # CUDA: a host-bound step launches onto an idle GPU (exposure then says little)
        figures["starved_launch_fraction"] = sum(s.idle_launches for s in kept) / launches
    dp, dp_exposed = sum(s.dp_reduce_s or 0.0 for s in kept), sum(s.dp_exposed_s or 0.0 for s in kept)
    tail = ""
    if dp > 0:  # the data-parallel gradient reduction (one-stage engines)
        figures.update(dp_reduce_ms_per_step=dp / n * 1e3, dp_exposed_ms_per_step=dp_exposed / n * 1e3)
        tail = f"; data-parallel reduction {dp / n * 1e3:.0f} ms/step, {dp_exposed / n * 1e3:.0f} ms after the backward"
    if comm > 0:
        return figures, (
            f"; schedule {schedule}: communication {comm / n * 1e3:.0f} ms/step, "
            f"{frac:.0%} hidden ({exposed / n * 1e3:.0f} ms exposed){tail}"
        )
    if dp > 0 and not exposed:  # nothing in the op graph to hide
        return figures, f"; schedule {schedule}: no collective inside the step's ops{tail}"
    # pipeline transfers only: no collective to hide inside a stage
    return figures, f"; schedule {schedule}: {exposed / n * 1e3:.0f} ms/step waiting on transfers"


def _print_data(d: dict, average: str) -> None:
    print(
        f"data: {d['format']} records, loss on {d['loss_on']} (averaged over {average}): "
        f"{d['records']} records, {d['tokens']} tokens, {d['loss_tokens']} with loss; {d['truncated']} cut to "
        f"--seq-len, {d['dropped']} dropped as longer, {d['no_loss']} without an answer left; padding "
        f"{d['padding_fraction']:.1%} (--packing {d['packing']}{', streamed: the part read' if d['streaming'] else ''})"
    )


def _print_memory(memory: list[dict] | None) -> None:
    if memory and memory[0].get("load_peak_rss_mib") is not None:
        m = memory[0]
        print(
            f"host memory, rank 0: load {m['load_peak_rss_mib'] - m['baseline_rss_mib']:.0f} MiB over the baseline "
            f"for a {m['shard_mib']:.0f} MiB shard, training peak {m['train_peak_rss_mib']:.0f} MiB"
        )
    if memory and "optimizer_state_bytes" in memory[0]:
        per_rank = ", ".join(f"{m['optimizer_state_bytes'] / 2**20:.2f}" for m in memory)
        m = memory[0]
        print(
            f"optimizer state per rank: {per_rank} MiB; trained parameters on rank 0: {m['trainable_parameters']:,} "
            f"of {m['parameters']:,} ({m['trainable_parameters'] / max(m['parameters'], 1):.1%})"
        )
    if memory and memory[0].get("held_parameters", 0) < memory[0].get("parameters", 0):
        held = ", ".join(f"{m['held_parameters']:,}" for m in memory)
        print(f"parameters held per rank (ZeRO-3 partitions): {held} of {memory[0]['parameters']:,}")


def flush_tensorboard(engine) -> None:
    """Flush the engine's TensorBoard writers (rank 0, at the run's end)."""
    import torch.distributed as dist

    if not engine.monitor.enabled or dist.get_rank() != 0:
        return
    for m in getattr(engine.monitor, "monitors", None) or []:
        w = getattr(m, "summary_writer", None)
        if w is not None:
            w.flush()
