"""Fine-tune an HF causal LM with DeepSpeed (+ ds_dhelix when the ds_config enables it).

    deepspeed --num_gpus 2 train.py --deepspeed ds_configs/tiny_llama_cpu.json

On a machine without GPUs DeepSpeed's CPU accelerator runs the ranks over gloo. Everything the run
needs is checked before any model is built; bad input gets one line of error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", required=True,
                   help="ds_config JSON (with an optional \"dhelix\" section)")
    p.add_argument("--model", default="tiny-llama",
                   help="preset (tiny-llama, tiny-gpt2, tiny-gpt-neox, tiny-phimoe) or a local HF checkpoint dir")
    p.add_argument("--data", default=None, help="local .txt or .jsonl (field 'text'); default: embedded corpus")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--output-dir", default="outputs/run", help="where the HF checkpoint goes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ds-checkpoint", default=None, help="also save a DeepSpeed checkpoint here at the end")
    p.add_argument("--resume", default=None, help="load a DeepSpeed checkpoint before training")
    p.add_argument("--json-summary", default=None, help="write the run summary (losses, timings) as JSON")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args(argv)


def check_inputs(args):
    """Everything that can be checked without a model: one ValueError line per mistake."""
    from ds_dhelix.build import check_setup
    from ds_dhelix.config import load_ds_config
    from hf_models.registry import load_config

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    ds_config = load_ds_config(args.deepspeed)
    model_config = load_config(args.model)  # unknown preset / missing dir -> ValueError
    if args.data is not None and not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data!r}: no such file (give a local .txt or .jsonl file)")
    setup = check_setup(ds_config, model_config, int(os.environ.get("WORLD_SIZE", 1)))
    tp = setup.dims.tp
    if args.seq_len % tp:
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by tensor_parallel.size {tp}")
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions")
    return ds_config, setup.dh, model_config, setup.batch


def set_schedule_length(ds_config, steps):
    sched = ds_config.get("scheduler", {})
    if sched.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params = sched.setdefault("params", {})
        params["total_num_steps"] = steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(steps // 5, 1))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ds_config, dh, model_config, batch_sizes = check_inputs(args)
    except ValueError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    run(args, ds_config, dh, batch_sizes)
    return 0


def run(args, ds_config, dh, batch_sizes):
    import deepspeed
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from ds_dhelix.data import batch_iterator, encode_text, build_embedded_corpus, load_text
    from hf_models.registry import build_model, load_tokenizer_for

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    set_schedule_length(ds_config, args.steps)
    if rank == 0:
        print(batch_sizes.table())

    tokenizer = load_tokenizer_for(args.model)
    text = load_text(args.data) if args.data else build_embedded_corpus()
    ids = encode_text(tokenizer, text)
    model, info = build_model(args.model, seed=args.seed)

    if dh.enabled:
        import ds_dhelix
        micro = ds_config.get("train_micro_batch_size_per_gpu", batch_sizes.micro_batch_size)
        first = ids[: micro * args.seq_len].view(micro, args.seq_len)
        engine, *_ = ds_dhelix.initialize(model=model, config=ds_config,
                                          example_batch={"input_ids": first, "labels": first.clone()})
        dp_rank, dp_size = engine.groups.dp_rank, engine.groups.dp_size
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        dp_rank, dp_size = rank, world
    if args.resume:
        engine.load_checkpoint(args.resume)
    micro = engine.train_micro_batch_size_per_gpu()
    data = batch_iterator(ids, micro, args.seq_len, seed=args.seed, rank=dp_rank, num_replicas=dp_size)

    losses, times, hidden = [], [], []
    bar = tqdm(total=args.steps, desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        if dh.enabled:
            loss = engine.train_batch(data)
            hidden.append(engine.last_stats)
        else:
            loss = plain_step(engine, data)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        tokens = micro * engine.gradient_accumulation_steps() * args.seq_len * dp_size
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / times[-1]:.0f}")
        bar.update(1)
    bar.close()

    probe = probe_loss(engine, dh, ids, micro, args.seq_len)
    if args.ds_checkpoint:
        engine.save_checkpoint(args.ds_checkpoint)
    if dh.enabled:
        path = engine.export_hf(args.output_dir, tokenizer)  # TP / EP / pipeline shards gathered
    else:
        from ds_dhelix.checkpoint import export_hf
        path = export_hf(engine.module, args.output_dir, tokenizer)
    summarize(args, rank, losses, times, hidden, path, micro, engine, dp_size, dh, probe)
    if engine.monitor.enabled and rank == 0:
        for writer in _tb_writers(engine):
            writer.flush()


def probe_loss(engine, dh, ids, micro, seq_len):
    """Loss of the trained model on the first tokens of the data: the exported HF checkpoint must
    reproduce it (the end-to-end test checks that)."""
    import torch
    block = ids[: micro * seq_len].view(micro, seq_len)
    batch = {"input_ids": block, "labels": block.clone()}
    if dh.enabled:
        loss = engine.eval_batch(iter([batch] * engine.gradient_accumulation_steps()))
    else:
        engine.eval()
        with torch.no_grad():
            loss = engine(**batch).loss
        engine.train()
    return {"probe_input_ids": block.tolist(), "probe_loss": float(loss)}


def plain_step(engine, data):
    """One optimizer step of plain DeepSpeed: forward/backward per micro-batch, then step."""
    import torch
    import torch.distributed as dist
    total = 0.0
    gas = engine.gradient_accumulation_steps()
    for _ in range(gas):
        batch = next(data)
        out = engine(input_ids=batch["input_ids"], labels=batch["labels"])
        engine.backward(out.loss)
        engine.step()
        total += out.loss.detach().float()
    loss = torch.as_tensor(total / gas)
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    if engine.monitor.enabled and engine.global_rank == 0:
        engine.monitor.write_events([("Train/loss", float(loss), engine.global_steps)])
    return loss


def _tb_writers(engine):
    for m in getattr(engine.monitor, "monitors", None) or []:
        w = getattr(m, "summary_writer", None)
        if w is not None:
            yield w


def summarize(args, rank, losses, times, stats, path, micro, engine, dp_size, dh, probe):
    import statistics
    if rank != 0:
        return
    k = max(1, len(losses) // 10)
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    med = statistics.median(times[1:] or times)
    tokens = micro * engine.gradient_accumulation_steps() * args.seq_len * dp_size
    summary = {"model": args.model, "steps": len(losses), "loss_first": first, "loss_last": last,
               "losses": losses, "median_step_s": med, "tokens_per_s": tokens / med, "hf_checkpoint": path}
    line = (f"done: {len(losses)} steps, loss {first:.3f} -> {last:.3f}, "
            f"median step {med * 1e3:.0f} ms, {tokens / med:.0f} tokens/s")
    if stats:
        comm = sum(s.comm_s for s in stats[1:] or stats)
        exposed = sum(s.exposed_s for s in stats[1:] or stats)
        frac = max(0.0, 1 - exposed / comm) if comm > 0 else 0.0
        n = len(stats[1:] or stats)
        summary.update(schedule=dh.schedule, comm_ms_per_step=comm / n * 1e3,
                       exposed_comm_ms_per_step=exposed / n * 1e3, hidden_fraction=frac,
                       peak_activation_bytes=max(s.peak_activation_bytes for s in stats))
        if comm > 0:
            line += (f"; schedule {dh.schedule}: communication {comm / n * 1e3:.0f} ms/step, "
                     f"{frac:.0%} hidden ({exposed / n * 1e3:.0f} ms exposed)")
        else:  # pipeline transfers only: no collective to hide inside a stage
            line += f"; schedule {dh.schedule}: {exposed / n * 1e3:.0f} ms/step waiting on transfers"
    print(line)
    print(f"HF checkpoint: {path}")
    summary.update(probe)
    if args.json_summary:
        with open(args.json_summary, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
