"""Fine-tune an HF causal LM with DeepSpeed (+ ds_dhelix when the ds_config enables it).

    deepspeed --num_gpus 2 train.py --deepspeed ds_configs/tiny_llama_cpu.json

On a machine without GPUs DeepSpeed's CPU accelerator runs the ranks over gloo. Everything the run
needs is checked before any model is built; bad input gets one line of error and exit code 2.
``--steps`` is the run's total: a resumed run continues from the checkpoint's step to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (the CLI reference in the docs is generated from this parser)."""
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", required=True,
                   help="ds_config JSON (with an optional \"dhelix\" section)")
    p.add_argument("--model", default="tiny-llama",
                   help="preset (tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-gemma3, tiny-phi3, tiny-smollm3, "
                        "tiny-olmo3, tiny-gpt2, tiny-gpt-neox; MoE tiny-phimoe, tiny-mixtral, tiny-qwen3-moe, "
                        "tiny-qwen2-moe, tiny-olmoe, tiny-deepseek-v3, tiny-glm4-moe, tiny-gpt-oss, tiny-qwen3-moe-mixed; small-llama, "
                        "small-phimoe: ~100M) or a local HF checkpoint dir "
                        "(each rank reads only its shards under dhelix)")
    p.add_argument("--data", default=None,
                   help="training data: .txt, .jsonl, .json, .parquet or a datasets.save_to_disk directory, read "
                        "through datasets; records of text, chat messages or prompt/completion (default: the embedded "
                        "corpus)")
    p.add_argument("--data-format", default=None, choices=["text", "chat", "prompt-completion"],
                   help="the records' format (default: told from the first record: 'messages' -> chat, 'prompt' and "
                        "'completion' -> prompt-completion, 'text' -> text)")
    p.add_argument("--loss-on", default=None, choices=["all", "answers"],
                   help="the tokens the loss is computed on (default: answers -- the assistant turns or the completion "
                        "-- for chat and prompt-completion, all for text)")
    p.add_argument("--chat-template", default=None, metavar="FILE|chatml",
                   help="Jinja chat template for chat records (default: the tokenizer's own; chatml: the built-in "
                        "ChatML one, for tokenizers without a template such as the presets')")
    p.add_argument("--loss-average", default=None, choices=["tokens", "microbatches"],
                   help="a step's loss: tokens -- its summed loss over its target count on every data-parallel "
                        "replica, like the HF Trainer's num_items_in_batch; microbatches -- the mean of its micro-batch "
                        "means (default: tokens when the loss is on the answers, whose count varies by micro-batch; "
                        "microbatches otherwise)")
    p.add_argument("--packing", default="concat", choices=["concat", "docs", "none"],
                   help="concat: records back to back (EOS after text and completions), crossing blocks; docs: "
                        "positions restart and attention is masked at each record, and chat / prompt-completion "
                        "records are never split (whole records per block, then padding); none: one record per block, "
                        "padded")
    p.add_argument("--drop-long", action="store_true",
                   help="leave out chat / prompt-completion records longer than --seq-len (default: cut them to it) "
                        "under --packing docs / none")
    p.add_argument("--data-workers", type=int, default=1, metavar="N", help="processes that tokenise the data")
    p.add_argument("--stream-above", default="256MB", metavar="SIZE",
                   help="stream a data file larger than SIZE (read and tokenised as the run goes, blocks shuffled in a "
                        "window, memory flat) instead of tokenising it whole first; 'never' to always tokenise whole")
    p.add_argument("--eval-data", default=None, metavar="FILE", help="evaluation data (same formats as --data)")
    p.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this fraction of --data's records (seeded by --seed) for evaluation")
    p.add_argument("--eval-interval", type=int, default=0, metavar="K",
                   help="evaluate every K steps and after the last (Eval/loss; default with evaluation data: at the end "
                        "only)")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps of the run (a resume continues to it)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--output-dir", default="outputs/run", help="where the HF checkpoint goes")
    p.add_argument("--overwrite-output-dir", action="store_true",
                   help="replace a regular file or a foreign non-empty directory at --output-dir; let checkpoints "
                        "go into a non-empty directory at --ds-checkpoint")
    p.add_argument("--seed", type=int, default=1234,
                   help="model init, data order, and dhelix.seed (dropout masks) unless the section sets it")
    p.add_argument("--ds-checkpoint", default=None, metavar="DIR",
                   help="DeepSpeed checkpoints go here (at the end, every --save-interval steps, on a stop)")
    p.add_argument("--save-interval", type=int, default=0, metavar="K", help="save a checkpoint every K steps (0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="N", help="complete checkpoints kept (newest)")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a checkpoint (a --ds-checkpoint dir or one of its tags); auto: the newest "
                        "complete one under --ds-checkpoint, if any")
    p.add_argument("--allow-resume-change", action="store_true",
                   help="resume although total steps, LR schedule, batch/parallel layout, model or data differ")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="leave after N steps of this process with a checkpoint (a job slot's time limit); the "
                        "run's schedule stays --steps long, --resume auto continues it (0: off)")
    p.add_argument("--save-on-signal", action="store_true",
                   help="on SIGTERM/SIGINT (or a vanished launcher) finish the step and save a checkpoint first")
    p.add_argument("--watchdog-s", type=float, default=None,
                   help="seconds without progress before a rank reports where it hangs and exits (default: the "
                        "config's dhelix.watchdog_s, 600)")
    p.add_argument("--attn-implementation", default=None, choices=["sdpa", "eager", "flash_attention_2"],
                   help="attention kernel (default: the checkpoint directory's config.json setting, else sdpa)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file of the HF export (e.g. 500MB, 5GB); bigger models get shards "
                        "and an index file")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter on the frozen model (rank --lora-r); the output is a PEFT adapter "
                        "directory (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--lora-r", type=int, default=None, metavar="R", help="LoRA rank (implies --lora; default 8)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="comma-separated module names LoRA wraps (default: every attention and MLP projection of the "
                        "model's family)")
    p.add_argument("--peft-config", default=None, metavar="FILE",
                   help="a PEFT LoRA adapter_config.json (instead of --lora-r / --lora-alpha / --lora-targets)")
    p.add_argument("--merge-lora", action="store_true",
                   help="with LoRA: write the merged model as an HF checkpoint instead of the adapter")
    p.add_argument("--json-summary", default=None, help="write the run summary as JSON (start_step, per-step losses and lrs, timings, probe "
                        "loss, per-rank memory)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the DeepSpeed launcher (default: $LOCAL_RANK, else 0)")
    return p


@dataclass
class Prepared:
    """What the checks before any model is built established."""

    ds_config: dict
    setup: object  # ds_dhelix.engine.build.Setup
    tokenizer: object
    data: object  # ds_dhelix.data.TrainingData: the training (and evaluation) blocks
    run_state: dict  # what a checkpoint of this run records
    resume: tuple[str, str] | None  # (checkpoint root, tag)
    memory: dict | None = None  # this rank's host memory marks (filled by build)
    lora: object = None  # the peft LoraConfig of --lora / --peft-config, else None


def check_inputs(args) -> Prepared:
    """Everything that can be checked without a model: one ValueError line per mistake."""
    from ds_dhelix.engine.build import check_setup
    from ds_dhelix.config.section import load_ds_config
    from hf_models.registry import check_weight_files, is_preset, load_config
    _check_flags(args)
    ds_config = load_ds_config(args.deepspeed)
    if args.watchdog_s is not None:
        if not (ds_config.get("dhelix") or {}).get("enabled"):
            raise ValueError("--watchdog-s sets the ds_dhelix engine's watchdog; this ds_config does not enable "
                             "dhelix (plain DeepSpeed has none)")
        ds_config["dhelix"]["watchdog_s"] = args.watchdog_s
    if (ds_config.get("dhelix") or {}).get("enabled"):
        ds_config["dhelix"].setdefault("seed", args.seed)  # dropout masks and router noise follow --seed
    model_config = load_config(args.model)  # unknown preset / missing dir -> ValueError
    if not is_preset(args.model):
        check_weight_files(os.path.expanduser(args.model))
        if (ds_config.get("dhelix") or {}).get("enabled"):
            from hf_models.loading import CheckpointFiles
            CheckpointFiles(os.path.expanduser(args.model))  # each rank reads its shards: safetensors only
    from hf_models.registry import resolve_attn_implementation
    args.attn_implementation = resolve_attn_implementation(args.attn_implementation, args.model)
    from ds_dhelix.engine.checkpoint import parse_size
    parse_size(args.max_shard_size, "--max-shard-size")
    setup = check_setup(ds_config, model_config, int(os.environ.get("WORLD_SIZE", 1)))
    if "optimizer" not in ds_config:
        raise ValueError('the ds_config has no "optimizer" section: train.py trains, so it needs one '
                         '(e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}})')
    _check_lengths(args, setup, model_config)
    _check_outputs(args)
    set_schedule_length(ds_config, args.steps)
    lora = lora_config(args, setup, model_config)
    tokenizer, data = _data(args, setup, model_config)
    state = run_state(args, ds_config, setup, data)
    state["adapter"] = adapter_state(lora)
    return Prepared(ds_config, setup, tokenizer, data, state, _check_resume(args, state), lora=lora)


def lora_config(args, setup, model_config):
    """The LoraConfig of --lora / --lora-r / --peft-config, checked against the model's family
    before any model is built; None for a full fine-tune."""
    asked = lora_asked(args)
    given = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets)) if v is not None]
    if not asked:
        if given or args.merge_lora:
            raise ValueError(f"{(given + ['--merge-lora'])[0]} sets up LoRA: add --lora (or --lora-r R)")
        return None
    if not setup.dh.enabled:
        raise ValueError("--lora trains through the ds_dhelix engine: enable the ds_config's dhelix section")
    from hf_models.adapters import check_lora_targets, lora_target_names
    from hf_models.lora import check_config
    from peft import LoraConfig
    if args.peft_config is not None:
        if args.lora_r is not None or given:
            raise ValueError("--peft-config gives the whole LoRA config: drop --lora-r / --lora-alpha / --lora-targets")
        try:
            with open(os.path.expanduser(args.peft_config)) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--peft-config {args.peft_config!r}: {err}") from None
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"--peft-config {args.peft_config!r} is a {raw['peft_type']} adapter; ds_dhelix trains LoRA")
        known = set(LoraConfig.__dataclass_fields__)
        dropped = sorted(set(raw) - known)
        if dropped and int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: --peft-config keys this PEFT's LoraConfig does not know, not used: {', '.join(dropped)}",
                  file=sys.stderr)
        cfg = LoraConfig(**{k: v for k, v in raw.items() if k in known and k != "peft_type"})
    else:
        r = 8 if args.lora_r is None else args.lora_r
        if r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {r}")
        if args.lora_alpha is not None and not args.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
        targets = None if args.lora_targets is None else [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        targets = check_lora_targets(model_config, targets, "--lora-targets")
        cfg = LoraConfig(r=r, lora_alpha=args.lora_alpha or 2 * r, target_modules=targets, lora_dropout=0.0)
    check_config(cfg)
    names = cfg.target_modules
    if not names or isinstance(names, str) and names != "all-linear":
        raise ValueError(f"LoRA target_modules {names!r}: give a list of module names, from: "
                         f"{', '.join(lora_target_names(model_config))}")
    if not isinstance(names, str):
        check_lora_targets(model_config, names)
    return cfg


def lora_asked(args) -> bool:
    return args.lora or args.lora_r is not None or args.peft_config is not None


def adapter_state(cfg) -> dict | None:
    """What a resume must match of the LoRA config (None: full fine-tune)."""
    if cfg is None:
        return None
    names = cfg.target_modules
    return {"r": cfg.r, "alpha": cfg.lora_alpha, "targets": names if isinstance(names, str) else sorted(names),
            "rslora": cfg.use_rslora}


def _check_flags(args) -> None:
    for name in ("steps", "seq_len", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("save_interval", "stop_after"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(args, name)}")
    if args.watchdog_s is not None and not args.watchdog_s > 0:
        raise ValueError(f"--watchdog-s must be > 0, got {args.watchdog_s}")
    for flag, on in (("--save-interval", args.save_interval > 0), ("--save-on-signal", args.save_on_signal),
                     ("--stop-after", args.stop_after > 0), ("--resume auto", args.resume == "auto")):
        if on and not args.ds_checkpoint:
            raise ValueError(f"{flag} needs --ds-checkpoint DIR (where the checkpoints go)")
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None:
            from ds_dhelix.data.records import data_kind
            try:
                data_kind(path)  # missing, a foreign directory, an unknown suffix: one line naming it
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    data_options(args)  # the data flags' own values
    if args.eval_interval < 0:
        raise ValueError(f"--eval-interval must be >= 0 (0: at the end only), got {args.eval_interval}")
    if args.eval_interval and not (args.eval_data or args.eval_fraction):
        raise ValueError("--eval-interval evaluates on --eval-data FILE or --eval-fraction F of --data: give one")


def _check_packing(args, setup, model_config) -> None:
    if args.packing == "none" and setup.dh.enabled and hasattr(model_config, "num_local_experts"):
        raise ValueError("--packing none pads documents, and the MoE router's load-balancing loss would count the "
                         "padded tokens (HF leaves them out); use --packing docs (or concat) with an MoE model")
    if args.packing == "docs" and args.attn_implementation == "flash_attention_2":
        raise ValueError("--packing docs masks attention across documents, which the ds_dhelix graph does not yet "
                         "pass to flash_attention_2; use sdpa or eager")
    from hf_models.adapters import check_packing  # the family's own (Gated DeltaNet layers: no packed documents;
    check_packing(model_config, args.packing)     # plain DeepSpeed's HF model would not keep them apart either)


def _check_lengths(args, setup, model_config) -> None:
    _check_packing(args, setup, model_config)
    d = setup.dims
    d.check_seq_len(args.seq_len, "--seq-len")
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit and args.seq_len > limit:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions")


def _check_outputs(args) -> None:
    from ds_dhelix.engine.checkpoint import check_output_dir, is_export
    from ds_dhelix.engine.resume import is_checkpoint_dir
    check_output_dir(args.output_dir, "--output-dir", args.overwrite_output_dir, ours=is_export)
    if args.ds_checkpoint:
        ckpt, out = (os.path.abspath(os.path.expanduser(p)) for p in (args.ds_checkpoint, args.output_dir))
        if os.path.commonpath([ckpt, out]) == out:
            raise ValueError(f"--ds-checkpoint {ckpt!r} lies in --output-dir {out!r}: the HF export replaces that "
                             f"directory whole, checkpoints included; give them separate paths")
        if os.path.isfile(ckpt):
            raise ValueError(f"--ds-checkpoint {ckpt!r} is a regular file; checkpoints need a directory there")
        check_output_dir(ckpt, "--ds-checkpoint", args.overwrite_output_dir, ours=is_checkpoint_dir)
    if args.json_summary:
        folder = os.path.dirname(os.path.abspath(args.json_summary))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json-summary {args.json_summary!r}: {folder!r} is not a writable directory")


def _data(args, setup, model_config):
    """The tokenizer and the run's data (``ds_dhelix.data.load_data``): enough blocks for one step
    on every replica, and for one evaluation micro-batch."""
    from ds_dhelix.data.sources import load_data
    from hf_models.registry import load_tokenizer_for
    tokenizer = load_tokenizer_for(args.model)
    data = load_data(data_options(args, tokenizer), tokenizer)
    need, d = setup.batch.micro_batch_size * setup.dims.dp, setup.dims
    if data.train is not None and len(data.train) < need:
        s = data.stats
        dropped = f", {s.dropped} left out as longer (--drop-long)" if s.dropped else ""
        raise ValueError(f"{args.data or 'the corpus'} has {s.tokens} tokens in {s.records} records{dropped}: "
                         f"{len(data.train)} blocks of --seq-len {args.seq_len} (--packing {args.packing}), fewer than one micro-batch "
                         f"({setup.batch.micro_batch_size}) on each of {d.dp} data-parallel replicas; use more data or a "
                         f"shorter --seq-len")
    if data.streaming:
        try:
            data.first_batch(need)  # the stream's first blocks (a look: the run reads it again)
        except ValueError as err:
            raise ValueError(f"{args.data}: {err}, one micro-batch ({setup.batch.micro_batch_size}) on each of "
                             f"{d.dp} data-parallel replicas; use more data or a shorter --seq-len") from None
    if data.eval is not None and len(data.eval) < need:
        raise ValueError(f"the evaluation data packs into {len(data.eval)} blocks, fewer than one micro-batch "
                         f"({setup.batch.micro_batch_size}) on each of {d.dp} data-parallel replicas")
    if data.stats.truncated and int(os.environ.get("RANK", 0)) == 0:
        print(f"train.py: {data.stats.truncated} of {data.stats.records} records are longer than --seq-len "
              f"{args.seq_len} and were cut to it (--drop-long leaves them out)", file=sys.stderr)
    if hasattr(model_config, "num_local_experts") and data.stats.padding_tokens and int(os.environ.get("RANK", 0)) == 0:
        print(f"train.py: {data.stats.padding_fraction:.1%} of the tokens are padding, which the MoE router's "
              f"load-balancing loss counts (as HF's does without an attention mask)", file=sys.stderr)
    return tokenizer, data


def data_options(args, tokenizer=None):
    """The ``DataOptions`` of the data flags (``tokenizer``: for its padding id)."""
    from ds_dhelix.data.sources import DataOptions, parse_size
    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = DataOptions(path=args.data, fmt=args.data_format, loss_on=args.loss_on, chat_template=args.chat_template,
                          packing=args.packing, seq_len=args.seq_len, drop_long=args.drop_long,
                          workers=args.data_workers, stream_above=parse_size(args.stream_above),
                          eval_path=args.eval_data, eval_fraction=args.eval_fraction, seed=args.seed, pad_id=pad)
    options.check()
    return options


def run_state(args, ds_config, setup, data) -> dict:
    """What a checkpoint of this run records, and a resume must match (``ds_dhelix.engine.resume``)."""
    from ds_dhelix.engine.build import zero_stage
    d, b = setup.dims, setup.batch
    source = os.path.abspath(os.path.expanduser(args.data)) if args.data else "embedded corpus"
    model = args.model if not os.path.isdir(os.path.expanduser(args.model)) else os.path.abspath(args.model)
    precision = {"zero_stage": zero_stage(ds_config), "gradient_clipping": ds_config.get("gradient_clipping"),
                 "fp16": ds_config.get("fp16"), "bf16": ds_config.get("bf16")}
    return {"step": 0, "total_steps": args.steps, "lr_schedule": ds_config.get("scheduler"),
            "optimizer": ds_config.get("optimizer"), "precision": precision,
            "layout": {"world": d.world, "dp": d.dp, "tp": d.tp, "pp": d.pp, "ep": d.ep, **({"cp": d.cp, "cp_comm": d.cp_comm} if d.cp > 1 else {}),
                       "micro_batch_size": b.micro_batch_size, "gradient_accumulation_steps": b.gradient_accumulation_steps},
            "model": model, "data": {"source": source, "seed": args.seed, **data.identity(),
                                     "loss_average": loss_average(args, data)},
            "seq_len": args.seq_len, "draw_seed": setup.dh.seed, "plan_fingerprint": None}


def _check_resume(args, state: dict) -> tuple[str, str] | None:
    """The checkpoint to continue from, checked against this run before any model is built."""
    from ds_dhelix.engine.resume import check_resume, complete_tags, locate, read_run_state
    if not args.resume:
        return None
    if args.resume == "auto":
        root = os.path.abspath(args.ds_checkpoint)
        if not complete_tags(root):
            return None  # nothing saved yet: a fresh start
    root, tag = locate(args.ds_checkpoint if args.resume == "auto" else args.resume)
    _report_changes(check_resume(read_run_state(root, tag), state, args.allow_resume_change))
    return root, tag


def _report_changes(diffs: list[str]) -> None:
    """What --allow-resume-change accepted, said once (rank 0)."""
    if diffs and int(os.environ.get("RANK", 0)) == 0:
        print("train.py: resuming with changes (--allow-resume-change): " + "; ".join(diffs), file=sys.stderr)


def set_schedule_length(ds_config, steps):
    """WarmupCosineLR / WarmupDecayLR run over --steps; a warmup longer than a fifth of them is
    shortened to that (and said so)."""
    sched = ds_config.get("scheduler") or {}
    if sched.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params = sched.setdefault("params", {})
        params["total_num_steps"] = steps
        warmup = params.get("warmup_num_steps", 0)
        params["warmup_num_steps"] = min(warmup, max(steps // 5, 1))
        if params["warmup_num_steps"] != warmup and int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: scheduler warmup_num_steps {warmup} shortened to {params['warmup_num_steps']} "
                  f"(a fifth of --steps {steps})", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prep = check_inputs(args)
    except ValueError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    return run(args, prep)


def run(args, prep: Prepared) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_dhelix.runtime.comm import CollectiveError, is_comm_failure
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    if dist.get_rank() == 0:
        print(prep.setup.batch.table())
    if args.ds_checkpoint and dist.get_rank() == 0:
        from ds_dhelix.engine.resume import remove_leftovers
        remove_leftovers(os.path.abspath(args.ds_checkpoint))
    engine = build(args, prep)
    try:
        code = train(args, prep, engine)
        teardown(engine)
        return code
    except RuntimeError as err:
        if not is_comm_failure(err):
            raise
        if not isinstance(err, CollectiveError):  # outside a step (a stop agreement, a save, the export)
            where = getattr(engine, "failure_position", lambda: "in plain DeepSpeed's engine")()
            err = CollectiveError(where, err, group=dist.group.WORLD)
        print(f"train.py: error: rank {dist.get_rank()}: {err} (step {_step(engine)})", file=sys.stderr, flush=True)
        os._exit(1)  # a peer is gone: no clean teardown of the process group is possible


def teardown(engine) -> None:
    """A clean end: every rank past its last collective, the engine's threads stopped and the
    process groups destroyed before the interpreter exits (a communication thread still running
    at exit aborts the process: "terminate called without an active exception", exit -6)."""
    import torch.distributed as dist
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


def _step(engine) -> int | str:
    """The step that failed: the watchdog's (it knows a step between two of DeepSpeed's), else the
    engine's next one."""
    wd = getattr(engine, "watchdog", None)
    step = wd.step if wd is not None and wd.step is not None else engine.global_steps
    return step + 1 if isinstance(step, int) else step


def run_dtype(ds_config: dict):
    """The dtype DeepSpeed trains the parameters in: bf16 / fp16 when enabled, else fp32."""
    import torch
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    return torch.float32


def build_model_for(args, prep: Prepared):
    """``(model, weights)``: a preset built whole from --seed; a checkpoint directory under dhelix
    as an empty (meta) model whose shards each rank reads from ``weights`` during the build, in the
    run's dtype; under plain DeepSpeed loaded whole."""
    from hf_models.registry import build_model, is_preset
    if prep.setup.dh.enabled and not is_preset(args.model):
        from hf_models.loading import empty_model
        path = os.path.expanduser(args.model)
        return empty_model(path, run_dtype(prep.ds_config), args.attn_implementation), path
    model, _ = build_model(args.model, seed=args.seed, attn_implementation=args.attn_implementation)
    return model, None


def build(args, prep: Prepared):
    """The model, the engine (ds_dhelix or plain DeepSpeed) and the checkpoint it resumes from."""
    import deepspeed

    from ds_dhelix.runtime.memory import peak_rss_mib, reset_peak_rss
    reset_peak_rss()
    baseline = peak_rss_mib()
    model, weights = build_model_for(args, prep)
    if prep.lora is not None:
        import torch
        from peft import get_peft_model
        torch.manual_seed(args.seed)  # the adapter's initial A (B starts at zero)
        model = get_peft_model(model, prep.lora)
    dh = prep.setup.dh
    if dh.enabled:
        import ds_dhelix
        first = prep.data.first_batch(prep.setup.batch.micro_batch_size)
        engine, *_ = ds_dhelix.initialize(model=model, config=prep.ds_config, weights=weights, example_batch=first)
        fingerprint = engine.plan.fingerprint() if getattr(engine, "plan", None) is not None else None
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=prep.ds_config)
        fingerprint = None
    report = getattr(engine, "load_report", None)
    prep.memory = {"baseline_rss_mib": baseline,
                   "load_peak_rss_mib": report.peak_rss_mib if report is not None else peak_rss_mib(),
                   "shard_mib": sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2 ** 20}
    reset_peak_rss()  # the training peak is measured from here
    prep.run_state["plan_fingerprint"] = fingerprint
    if prep.resume is not None:
        from ds_dhelix.engine.resume import load
        saved = load(engine, *prep.resume)
        if saved.get("plan_fingerprint") != fingerprint and int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: the SI plan differs from the checkpoint's ({saved.get('plan_fingerprint')} -> "
                  f"{fingerprint}); every plan gives the same math, so the run continues", file=sys.stderr)
    return engine


def train(args, prep: Prepared, engine) -> int:
    """The training loop: steps to ``--steps``, periodic checkpoints, stops; then the HF export."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ds_dhelix.engine.stopping import StopRequest
    rank, dp_rank, dp_size = dist.get_rank(), *_data_parallel(engine, prep)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    start = engine.global_steps
    data = prep.data.batches(micro, seed=args.seed, rank=dp_rank, replicas=dp_size, start=start * gas)
    if loss_average(args, prep.data) == "tokens":
        data = weighed_by_targets(data, gas, dp_size, engine.groups.dp_group if prep.setup.dh.enabled else None)
    stop = StopRequest.install()
    log = {"losses": [], "times": [], "stats": [], "lrs": [], "eval_losses": []}
    log_data_fields(engine, prep.data, start)
    bar = tqdm(total=args.steps, initial=start, desc="train", disable=rank != 0, dynamic_ncols=True)
    for _ in range(start, args.steps):
        _one_step(engine, prep.setup.dh, data, log, micro * gas * args.seq_len * dp_size, bar)
        if args.eval_interval and engine.global_steps % args.eval_interval == 0 and engine.global_steps < args.steps:
            log["eval_losses"].append(evaluate(engine, prep, micro))
        reason = stop.agreed()
        if reason and engine.global_steps < args.steps:  # after the last step: finish (export) instead
            return _stopped(args, prep, engine, stop, reason, bar)
        if engine.global_steps < args.steps and args.stop_after and engine.global_steps - start >= args.stop_after:
            bar.close()
            path = save(args, prep, engine)
            memory = memory_marks(prep, engine)
            if rank == 0:
                print(f"train.py: leaving after step {engine.global_steps} of {args.steps} (--stop-after "
                      f"{args.stop_after}); checkpoint {path}; continue with --resume auto")
                summarize(args, log, start, None, micro, engine, dp_size, prep.setup.dh, {}, memory, prep.data)
            return 0
        if args.save_interval and engine.global_steps % args.save_interval == 0 and engine.global_steps < args.steps:
            save(args, prep, engine)
    bar.close()
    stop.close()
    if prep.data.eval is not None and start < args.steps:
        log["eval_losses"].append(evaluate(engine, prep, micro))
    finish(args, prep, engine, log, start, micro, dp_size)
    return 0


def loss_average(args, data) -> str:
    """``--loss-average``, or its default for the data (tokens when the loss is on the answers)."""
    return args.loss_average or ("tokens" if data.loss_on == "answers" else "microbatches")


def weighed_by_targets(batches, gas: int, dp_size: int, dp_group):
    """The micro-batches, each step's ``gas`` carrying the step's ``loss_denominator``: its target
    count over every data-parallel replica / (gas x replicas), so the engine's mean over micro-
    batches and replicas is the step's summed loss over its targets (one all-reduce per step)."""
    import torch
    import torch.distributed as dist

    from ds_dhelix.data import valid_targets
    while True:
        step = [next(batches) for _ in range(gas)]
        count = torch.tensor([float(sum(valid_targets(b["labels"]) for b in step))], dtype=torch.float64)
        if dp_size > 1:
            dist.all_reduce(count, group=dp_group)
        denominator = max(float(count) / (gas * dp_size), 1e-12)
        yield from ({**b, "loss_denominator": denominator} for b in step)


def evaluate(engine, prep: Prepared, micro: int) -> dict:
    """``{"step", "loss"}``: the loss over every evaluation block, weighted by the targets each
    micro-batch counts (answer tokens), over all data-parallel replicas; forward only. Each
    replica takes every dp-th block; a replica short of a full micro-batch pads it with blocks
    whose targets are all ignored (a micro-batch of padding only keeps its targets, weighed 0), so
    every replica runs the same forwards."""
    import torch
    import torch.distributed as dist

    from ds_dhelix.data import valid_targets
    blocks, (dp_rank, dp_size) = prep.data.eval, _data_parallel(engine, prep)
    per_rank = -(-len(blocks) // dp_size)
    count = -(-per_rank // micro)
    mine = list(range(dp_rank, len(blocks), dp_size))
    batches, weights = [], []
    for k in range(count):
        real = mine[k * micro:(k + 1) * micro]
        rows = blocks.rows(torch.tensor(real + [0] * (micro - len(real))))
        if real and len(real) < micro:
            rows["labels"][len(real):] = -100
        weights.append(valid_targets(rows["labels"]) if real else 0)
        batches.append(rows)
    total = torch.zeros(2, dtype=torch.float64)
    gas = engine.gradient_accumulation_steps()
    with _watched(engine, "evaluation"):
        for lo in range(0, count, gas):
            chunk = batches[lo:lo + gas]
            if prep.setup.dh.enabled:
                losses = engine.eval_batch(iter(chunk), num_microbatches=len(chunk), per_microbatch=True).cpu()
            else:
                losses = torch.stack([_plain_forward_loss(engine, b) for b in chunk])
            for loss, w in zip(losses.tolist(), weights[lo:lo + gas]):
                if w:
                    total += torch.tensor([loss * w, w], dtype=torch.float64)
        group = engine.groups.dp_group if prep.setup.dh.enabled else None
        if dp_size > 1:
            dist.all_reduce(total, group=group)
    loss = float(total[0] / total[1])
    step = engine.global_steps
    if engine.monitor.enabled and dist.get_rank() == 0:
        engine.monitor.write_events([("Eval/loss", loss, step)])
    if dist.get_rank() == 0:
        print(f"train.py: step {step}: eval loss {loss:.4f} over {int(total[1])} target tokens", flush=True)
    return {"step": step, "loss": loss}


def _plain_forward_loss(engine, batch):
    import torch
    engine.eval()
    with torch.no_grad():
        out = engine(**plain_inputs(engine, batch))
    engine.train()
    return out.loss.detach().float().cpu()


def plain_inputs(engine, batch: dict) -> dict:
    """The HF model's keyword arguments for ``batch`` under plain DeepSpeed: the packed documents'
    mask (additive in the parameters' dtype for eager attention), and a ``loss_denominator`` as
    HF's ``num_items_in_batch``."""
    from ds_dhelix.data import hf_model_inputs
    from hf_models.common import hf_mask_windows
    module = engine.module
    eager = next(module.parameters()).dtype if module.config._attn_implementation == "eager" else None
    batch = dict(batch)
    denominator = batch.pop("loss_denominator", None)
    extra = {} if denominator is None else {"num_items_in_batch": denominator}
    return {**hf_model_inputs(batch, eager, hf_mask_windows(module.config)), **extra}


def log_data_fields(engine, data, step: int) -> None:
    """What the loss is computed on, in TensorBoard (``Data/...``, at the run's first step)."""
    import torch.distributed as dist
    if not engine.monitor.enabled or dist.get_rank() != 0:
        return
    s = data.stats
    engine.monitor.write_events([(f"Data/{k}", float(v), step) for k, v in
                                 (("records", s.records), ("tokens", s.tokens), ("loss_tokens", s.loss_tokens),
                                  ("truncated", s.truncated), ("dropped", s.dropped),
                                  ("padding_fraction", s.padding_fraction))])


def _data_parallel(engine, prep: Prepared) -> tuple[int, int]:
    import torch.distributed as dist
    if prep.setup.dh.enabled:
        return engine.groups.dp_rank, engine.groups.dp_size
    return dist.get_rank(), dist.get_world_size()


def _one_step(engine, dh, data, log: dict, tokens: int, bar) -> None:
    t0 = time.perf_counter()
    if dh.enabled:
        loss = engine.train_batch(data)
        log["stats"].append(engine.last_stats)
    else:
        loss = plain_step(engine, data)
    log["times"].append(time.perf_counter() - t0)
    log["losses"].append(float(loss))
    log["lrs"].append(float(engine.get_lr()[0]))
    bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", tok_s=f"{tokens / log['times'][-1]:.0f}")
    bar.update(1)


def _watched(engine, what: str):
    """The ds_dhelix engine's watchdog around ``what`` (plain DeepSpeed has none)."""
    import contextlib
    return engine.watched(what) if hasattr(engine, "watched") else contextlib.nullcontext()


def save(args, prep: Prepared, engine) -> str:
    """A checkpoint of the current step under --ds-checkpoint (the newest --keep-checkpoints kept)."""
    from ds_dhelix.engine import resume
    state = dict(prep.run_state, step=engine.global_steps)
    with _watched(engine, "checkpoint save"):
        return resume.save(engine, os.path.abspath(args.ds_checkpoint), state, args.keep_checkpoints)


def _stopped(args, prep: Prepared, engine, stop, reason: str, bar) -> int:
    import torch.distributed as dist
    bar.close()
    saved = save(args, prep, engine) if args.save_on_signal else None
    if dist.get_rank() == 0:
        what = f"; checkpoint saved to {saved}" if saved else " (no checkpoint: --save-on-signal was not given)"
        print(f"train.py: stopped by {reason} after step {engine.global_steps}{what}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(stop.exit_code())  # every rank leaves at the same step boundary


def finish(args, prep: Prepared, engine, log: dict, start: int, micro: int, dp_size: int) -> None:
    """The final checkpoint, the HF export, the summary line and JSON."""
    import torch.distributed as dist
    dh = prep.setup.dh
    probe = probe_loss(engine, dh, prep.data, micro)
    if args.ds_checkpoint and start < engine.global_steps:  # (a resume at the end only exports)
        save(args, prep, engine)
    with _watched(engine, "HF export"):
        if prep.lora is not None and not args.merge_lora:
            path = engine.export_adapter(args.output_dir, base=prep.run_state["model"], tokenizer=prep.tokenizer)
        elif dh.enabled:  # (a LoRA model: merged)
            path = engine.export_hf(args.output_dir, prep.tokenizer, max_shard_size=args.max_shard_size)
        else:
            from ds_dhelix.engine.checkpoint import export_hf
            path = export_hf(engine.module, args.output_dir, prep.tokenizer, max_shard_size=args.max_shard_size)
    memory = memory_marks(prep, engine)
    if dist.get_rank() == 0:
        summarize(args, log, start, path, micro, engine, dp_size, dh, probe, memory, prep.data)
    if engine.monitor.enabled and dist.get_rank() == 0:
        for writer in _tb_writers(engine):
            writer.flush()


def memory_marks(prep: Prepared, engine) -> list[dict]:
    """Every rank's host memory marks (collective): baseline, load peak, training peak, shard; and
    under ds_dhelix its optimizer's state bytes and its trainable / all parameter counts."""
    import torch.distributed as dist

    from ds_dhelix.runtime.memory import peak_rss_mib
    mine = {"rank": dist.get_rank(), **(prep.memory or {}), "train_peak_rss_mib": peak_rss_mib(),
            **({"optimizer_state_bytes": engine.optimizer_state_bytes(),
                "trainable_parameters": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
                "parameters": sum(p.numel() for p in engine.module.parameters())}
               if hasattr(engine, "optimizer_state_bytes") else {})}
    marks = [None] * dist.get_world_size()
    dist.all_gather_object(marks, mine)
    return marks


def probe_loss(engine, dh, data, micro):
    """Loss of the trained model on the first blocks of the data (their ids and labels, no
    positions or masks): the exported HF checkpoint must reproduce it (the end-to-end test checks
    that)."""
    import torch
    first = data.first_batch(micro)
    block = first["input_ids"]
    batch = {"input_ids": block, "labels": first["labels"]}
    if dh.enabled:
        loss = engine.eval_batch(iter([batch] * engine.gradient_accumulation_steps()))
    else:
        engine.eval()
        with torch.no_grad():
            loss = engine(**batch).loss
        engine.train()
    return {"probe_input_ids": block.tolist(), "probe_labels": first["labels"].tolist(), "probe_loss": float(loss)}


def plain_step(engine, data):
    """One optimizer step of plain DeepSpeed: forward/backward per micro-batch, then step."""
    import torch
    import torch.distributed as dist
    total = 0.0
    gas = engine.gradient_accumulation_steps()
    for _ in range(gas):
        out = engine(**plain_inputs(engine, next(data)))
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


def summarize(args, log: dict, start: int, path, micro, engine, dp_size, dh, probe, memory, data):
    import statistics
    losses, times, stats = log["losses"], log["times"], log["stats"]
    k = max(1, len(losses) // 10)
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    med = statistics.median(times[1:] or times)
    tokens = micro * engine.gradient_accumulation_steps() * args.seq_len * dp_size
    summary = {"model": args.model, "attn_implementation": args.attn_implementation, "start_step": start, "steps": len(losses), "total_steps": args.steps,
               "loss_first": first, "loss_last": last, "losses": losses, "lrs": log["lrs"],
               "median_step_s": med, "tokens_per_s": tokens / med, "hf_checkpoint": path,
               "eval_losses": log["eval_losses"], "data": {**data.summary(), "loss_average": loss_average(args, data)}}
    line = (f"done: steps {start + 1}-{start + len(losses)}, loss {first:.3f} -> {last:.3f}, "
            f"median step {med * 1e3:.0f} ms, {tokens / med:.0f} tokens/s")
    if stats:
        comm = sum(s.comm_and_exposed[0] for s in stats[1:] or stats)  # CUDA: from CUDA events
        exposed = sum(s.comm_and_exposed[1] for s in stats[1:] or stats)
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
    d = data.summary()
    print(f"data: {d['format']} records, loss on {d['loss_on']} (averaged over {loss_average(args, data)}): "
          f"{d['records']} records, {d['tokens']} tokens, {d['loss_tokens']} with loss; {d['truncated']} cut to "
          f"--seq-len, {d['dropped']} dropped as longer, {d['no_loss']} without an answer left; padding "
          f"{d['padding_fraction']:.1%} (--packing {d['packing']}{', streamed: the part read' if d['streaming'] else ''})")
    if log["eval_losses"]:
        print("eval loss: " + ", ".join(f"step {e['step']} {e['loss']:.4f}" for e in log["eval_losses"]))
    auto = getattr(engine, "auto", None)
    if auto is not None:  # "schedule": "auto": what it chose, from which figures
        from ds_dhelix.planning.autoschedule import describe
        summary["auto_decisions"] = auto.decisions
        print("\n".join(describe(d) for d in auto.decisions) if auto.decisions else
              f"ds_dhelix: schedule auto still timing its candidates ({auto.trial_steps_left} trial steps left)")
    if path:
        print(f"{'PEFT adapter' if lora_asked(args) and not args.merge_lora else 'HF checkpoint'}: {path}")
    summary.update(probe)
    summary["memory"] = memory
    if memory and memory[0].get("load_peak_rss_mib") is not None:
        m = memory[0]
        print(f"host memory, rank 0: load {m['load_peak_rss_mib'] - m['baseline_rss_mib']:.0f} MiB over the baseline "
              f"for a {m['shard_mib']:.0f} MiB shard, training peak {m['train_peak_rss_mib']:.0f} MiB")
    if memory and "optimizer_state_bytes" in memory[0]:
        per_rank = ", ".join(f"{m['optimizer_state_bytes'] / 2 ** 20:.2f}" for m in memory)
        m = memory[0]
        print(f"optimizer state per rank: {per_rank} MiB; trained parameters on rank 0: {m['trainable_parameters']:,} "
              f"of {m['parameters']:,} ({m['trainable_parameters'] / max(m['parameters'], 1):.1%})")
    if args.json_summary:
        with open(args.json_summary, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
