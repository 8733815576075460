"""Fine-tune a causal LM with ``ds_dhelix.DhelixTrainer`` (a Hugging Face ``Trainer``): TP/EP and
strand interleaving from the ds_config's "dhelix" section.

    torchrun --nproc_per_node 2 examples/trainer_sft.py --deepspeed ds_configs/tiny_llama_cpu.json \\
        --model tiny-llama --max-steps 20 --json-summary summary.json
    deepspeed --num_gpus 2 examples/trainer_sft.py --deepspeed ds_configs/tiny_llama_cpu.json ...
    accelerate launch --config_file ds_configs/accelerate_deepspeed.yaml examples/trainer_sft.py ...

``--model``: a preset (random init) or a local HF checkpoint directory; ``--data``: a file of text,
chat or prompt/completion records read as train.py reads it (default: the embedded corpus), packed
into blocks of ``--seq-len`` tokens with the loss on the answers. The ds_config's
numbers (micro-batch, accumulation, learning rate, betas, clipping, warmup) become the
TrainingArguments, so a config written for train.py runs unchanged; "auto" values follow the
TrainingArguments defaults. ``--plain`` trains the same run with ``transformers.Trainer`` and plain
DeepSpeed data parallelism (the dhelix section removed, the same tokens per optimizer step), to
compare. The trained model is written as an HF checkpoint to ``<output-dir>/final``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


SFT_DATA_FLAGS = ("data", "data_format", "loss_on", "chat_template", "packing", "drop_long")
"""train.py's data flags this script takes (``ds_dhelix.training.options.DataFlags``): the records
and their packing; streaming and held-out fractions are train.py's."""


def parse_args(argv=None):
    from ds_dhelix.config.flags import RawDescriptionDefaultsFormatter, StrictParser, add_flags, from_namespace
    from ds_dhelix.training.options import DataFlags, ModelFlags

    p = StrictParser(
        prog="trainer_sft.py", description=__doc__.split("\n\n")[0], formatter_class=RawDescriptionDefaultsFormatter
    )
    p.add_argument(
        "--deepspeed",
        default=None,
        help='ds_config JSON with a "dhelix" section (default under accelerate launch: the '
        "deepspeed_config_file of its config)",
    )
    add_flags(p, ModelFlags, "model")  # train.py's --model, --tokenizer, --attn-implementation
    add_flags(p, DataFlags, "data", only=SFT_DATA_FLAGS)
    p.add_argument(
        "--train-py-order",
        action="store_true",
        help="feed the blocks in train.py's order (its first epoch's shuffle by --seed, read in sequence) "
        "so both entry points train on the same micro-batches; one data-parallel replica only",
    )
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--output-dir", default="runs/trainer_sft")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--resume-from-checkpoint",
        default=None,
        help="a checkpoint-N folder of an earlier run, or 'last' for the newest in --output-dir",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end after N steps as if interrupted (the LR schedule still spans --max-steps)",
    )
    p.add_argument("--save-steps", type=int, default=0, help="Trainer checkpoint every N steps (0: none)")
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--eval-blocks", type=int, default=0, help="hold out N blocks and report eval_loss at the end")
    p.add_argument("--json-summary", default=None, help="write engine, layout, losses and checkpoint path here")
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        metavar="R",
        help="wrap the model in a PEFT LoRA of rank R on the attention and MLP projections (0: full "
        "fine-tune); save_model then writes the PEFT adapter",
    )
    p.add_argument("--plain", action="store_true", help="transformers.Trainer + plain DeepSpeed, for comparison")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    args.model_flags, args.data_flags = from_namespace(ModelFlags, args), from_namespace(DataFlags, args)
    from_accelerate = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if args.deepspeed is None:
        if not from_accelerate:
            p.error("--deepspeed DS_CONFIG is required (or accelerate launch with a deepspeed_config_file)")
        args.deepspeed = from_accelerate
    elif from_accelerate and os.path.realpath(from_accelerate) != os.path.realpath(args.deepspeed):
        p.error(
            f"--deepspeed {args.deepspeed} differs from accelerate's deepspeed_config_file {from_accelerate}; "
            f"pass one of them"
        )
    for name in ("max_steps", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    resume = args.resume_from_checkpoint
    if resume not in (None, "last") and not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        p.error(
            f"--resume-from-checkpoint {resume!r} is not a Trainer checkpoint (no trainer_state.json there); "
            f"give a checkpoint-N folder or 'last'"
        )
    return args


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def training_arguments(args, ds_config: dict):
    """TrainingArguments that agree with the ds_config's written numbers (HF refuses mismatches)."""
    from transformers import TrainingArguments

    opt = (ds_config.get("optimizer") or {}).get("params", {})
    sched = (ds_config.get("scheduler") or {}).get("params", {})
    values = {
        "per_device_train_batch_size": _number(ds_config.get("train_micro_batch_size_per_gpu")),
        "gradient_accumulation_steps": _number(ds_config.get("gradient_accumulation_steps")),
        "learning_rate": _number(opt.get("lr")),
        "weight_decay": _number(opt.get("weight_decay")),
        "adam_epsilon": _number(opt.get("eps")),
        "max_grad_norm": _number(ds_config.get("gradient_clipping")),
        "warmup_steps": _number(sched.get("warmup_num_steps")),
    }
    betas = opt.get("betas")
    if isinstance(betas, list) and all(_number(b) is not None for b in betas):
        values.update(adam_beta1=betas[0], adam_beta2=betas[1])
    values = {k: v for k, v in values.items() if v is not None}
    precision = {
        "bf16": bool((ds_config.get("bf16") or {}).get("enabled")),
        "fp16": bool((ds_config.get("fp16") or {}).get("enabled")),
    }
    max_steps = args.max_steps
    if args.plain and _number(sched.get("total_num_steps")):
        # HF refuses a written schedule length other than max_steps; the comparison keeps the
        # schedule and stops after --max-steps (StopAfter)
        max_steps = max(max_steps, sched["total_num_steps"])
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=max_steps,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=args.logging_steps,
        report_to=["tensorboard"],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        deepspeed=ds_config,
        dataloader_drop_last=True,
        use_cpu=not _has_cuda(),
        train_sampling_strategy="sequential" if args.train_py_order else "random",
        per_device_eval_batch_size=values.get("per_device_train_batch_size", 8),
        **precision,
        **values,
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def plain_config(ds_config: dict, world: int) -> dict:
    """The comparison run: no dhelix section; data parallel over the world with the accumulation cut
    so one optimizer step trains the same tokens as the dhelix layout."""
    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.config.section import DhelixConfig

    plain = copy.deepcopy(ds_config)
    dims = ParallelDims.from_config(DhelixConfig.from_ds_config(plain), world)
    plain.pop("dhelix", None)
    gas = plain.get("gradient_accumulation_steps")
    if isinstance(gas, int):
        if (gas * dims.dp) % world:
            raise SystemExit(
                f"--plain: {gas} accumulation steps x {dims.dp} data-parallel ranks do not split "
                f"over {world} plain data-parallel ranks"
            )
        plain["gradient_accumulation_steps"] = gas * dims.dp // world
    return plain


def datasets(args, tokenizer, vocab_size: int):
    """The training and evaluation blocks, read, encoded and packed as train.py does it (its data
    flags and ``data_options``, then ``ds_dhelix.data.load_data``); text, chat and prompt/completion
    records (preference pairs, unpaired completions and rollouts are train.py's objectives)."""
    import torch

    from ds_dhelix.data.sources import load_data
    from ds_dhelix.training.options import RunOptions
    from ds_dhelix.training.run_data import OBJECTIVE_DATA, data_options, resolve_packing

    options = RunOptions(
        deepspeed=args.deepspeed, seq_len=args.seq_len, seed=args.seed, model=args.model_flags, data=args.data_flags
    )
    try:
        given = data_options(resolve_packing(options), tokenizer, stream_above=None, vocab_size=vocab_size)
        data = load_data(given, tokenizer)
    except ValueError as err:
        raise SystemExit(f"trainer_sft.py: error: {err}") from None
    if data.format in OBJECTIVE_DATA:
        raise SystemExit(
            f"trainer_sft.py: error: --data holds {OBJECTIVE_DATA[data.format]}; this script fine-tunes on "
            f"text, chat or prompt/completion records (train.py --objective trains on these)"
        )
    blocks = data.train
    if args.train_py_order:  # train.py's first epoch: blocks shuffled with --seed, read in sequence
        blocks = torch.utils.data.Subset(
            blocks, torch.randperm(len(blocks), generator=torch.Generator().manual_seed(args.seed)).tolist()
        )
    if args.eval_blocks <= 0:
        return blocks, None
    n = len(blocks)
    if args.eval_blocks >= n:
        raise SystemExit(f"--eval-blocks {args.eval_blocks}: the data has only {n} blocks of {args.seq_len} tokens")
    return (
        torch.utils.data.Subset(blocks, range(n - args.eval_blocks)),
        torch.utils.data.Subset(blocks, range(n - args.eval_blocks, n)),
    )


def _stop_after(steps: int):
    """Trainer callback ending training after ``steps`` optimizer steps."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= steps:
                control.should_training_stop = True

    return StopAfter()


def _loss_log():
    """Trainer callback collecting the logged training loss of every step (``.losses``)."""
    from transformers import TrainerCallback

    class LossLog(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and "train_runtime" not in logs:
                self.losses.append((state.global_step, logs["loss"]))

    return LossLog()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from ds_dhelix.config.section import load_ds_config
    from hf_models.registry import build_model, load_tokenizer_for, resolve_attn_implementation

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds_config = load_ds_config(args.deepspeed)
    if args.train_py_order:
        from ds_dhelix.config.dims import ParallelDims
        from ds_dhelix.config.section import DhelixConfig

        dp = world if args.plain else ParallelDims.from_config(DhelixConfig.from_ds_config(ds_config), world).dp
        if dp != 1:
            raise SystemExit(
                f"trainer_sft.py: error: --train-py-order reads the blocks in one sequence, for one "
                f"data-parallel replica; this layout has {dp}"
            )
    if args.plain:
        ds_config = plain_config(ds_config, world)
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", os.path.join(args.output_dir, "tensorboard"))
    targs = training_arguments(args, ds_config)
    tokenizer = load_tokenizer_for(args.model, tokenizer=args.tokenizer)
    attention = resolve_attn_implementation(args.attn_implementation, args.model)
    model, _ = build_model(args.model, seed=args.seed, attn_implementation=attention)
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        from hf_models.adapters import lora_target_names

        torch.manual_seed(args.seed)  # the adapter's initial A (B starts at zero)
        model = get_peft_model(
            model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=lora_target_names(model.config))
        )
    train_set, eval_set = datasets(args, tokenizer, model.config.vocab_size)
    losses = _loss_log()
    if args.plain:
        from transformers import Trainer as trainer_class
    else:
        from ds_dhelix import DhelixTrainer as trainer_class
    stop = _stop_after(min(args.stop_after or args.max_steps, args.max_steps))
    trainer = trainer_class(
        model=model,
        args=targs,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        callbacks=[losses, stop],
    )
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    metrics = trainer.evaluate() if eval_set is not None else {}
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    engine = trainer.model_wrapped
    groups = getattr(engine, "groups", None)
    summary = {
        "engine": type(engine).__name__,
        "tp_size": groups.tp_size if groups else 1,
        "ep_size": groups.dims.ep if groups else 1,
        "cp_size": groups.dims.cp if groups else 1,
        "cp_comm": groups.dims.cp_comm if groups else None,
        "schedule": engine.dhelix.schedule if hasattr(engine, "dhelix") else "plain",
        "zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
        # parameter elements this rank holds (ZeRO-3: its partitions) and the model's on this rank
        "held_parameters": sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters()
        ),
        "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
        "losses": getattr(trainer, "step_losses", None) or [loss for _, loss in losses.losses],
        "logged_losses": [loss for _, loss in losses.losses],
        "eval_loss": metrics.get("eval_loss"),
        "hf_checkpoint": os.path.abspath(final),
    }
    if args.json_summary and trainer.args.process_index == 0:
        with open(args.json_summary, "w") as f:
            json.dump(summary, f, indent=1)
    if trainer.args.process_index == 0:
        print(
            f"[trainer_sft] {summary['engine']} tp {summary['tp_size']} cp {summary['cp_size']} ep {summary['ep_size']} "
            f"{summary['schedule']}: {len(summary['losses'])} steps, last loss "
            f"{summary['losses'][-1] if summary['losses'] else None}; HF checkpoint {final}"
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        if hasattr(engine, "destroy"):
            engine.destroy()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
