"""train.py's command line, typed: ``RunOptions`` and its groups, one field per flag with its type,
default, help and check (``ds_dhelix.config.flags``); the parser is built from them, and so is the
generated CLI reference.

    RunOptions          --deepspeed, --steps, --seq-len, --seed, --eval-interval, --watchdog-s, ...
      .model   ModelFlags        --model, --tokenizer, --attn-implementation
      .data    DataFlags         --data, --data-format, --packing, --eval-data, ...
      .objective ObjectiveFlags  --objective, --beta, --loss-average
      .checkpoints CheckpointFlags --ds-checkpoint, --save-interval, --resume, --stop-after, ...
      .output  OutputFlags       --output-dir, --overwrite-output-dir, --max-shard-size
      .lora    LoraFlags         --lora, --lora-r, --lora-alpha, --peft-config, --merge-lora, ...

    options = parse_options(["--deepspeed", "ds.json", "--steps", "20"])
    check_options(options)                  # the checks that need nothing but the flags

A script of one's own can declare its flags from the same groups (``add_flags(parser, DataFlags)``,
as ``examples/trainer_sft.py`` does) and build the data the same way (``data_options``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config.flags import StrictParser, above, add_flags, at_least, check_flags, flag, from_namespace, group

PROG = "train.py"
DESCRIPTION = "Fine-tune an HF causal LM with DeepSpeed (+ ds_dhelix when the ds_config enables it)."
DATA_FORMATS = ("text", "chat", "prompt-completion", "preference", "unpaired", "rollouts")
OBJECTIVES = ("cross_entropy", "dpo", "ipo", "simpo", "orpo", "kto", "grpo")
LOSS_AVERAGES = ("tokens", "microbatches")  # (ds_dhelix.training.loop's, which imports torch)


def say(text: str) -> None:
    """One line on stderr from rank 0 (under the launcher every rank checks the same flags)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{PROG}: {text}", file=sys.stderr)


def presets() -> tuple[list[str], list[str], list[str]]:
    """The built-in presets (hf_models/presets/, read without importing torch): tiny dense, tiny
    MoE, small (~100M)."""
    import hf_models

    dense, moe, small = [], [], []
    for path in sorted((Path(hf_models.__file__).parent / "presets").glob("*.json")):
        keys = json.loads(path.read_text())
        experts = any(k in keys for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        (small if path.stem.startswith("small-") else moe if experts else dense).append(path.stem)
    return dense, moe, small


def model_help() -> str:
    dense, moe, small = presets()
    return (
        f"preset ({', '.join(dense)}; MoE {', '.join(moe)}; {', '.join(small)}: ~100M) or a local HF "
        f"checkpoint dir (each rank reads only its shards under dhelix)"
    )


@dataclass
class ModelFlags:
    """The model, its tokenizer and attention kernel."""

    model: str = flag("tiny-llama", model_help)
    tokenizer: str | None = flag(
        None,
        "tokenizer directory (default: the checkpoint's own, the embedded-corpus tokenizer for presets; a "
        "checkpoint without tokenizer files and a vocabulary larger than the embedded tokenizer's is refused); "
        "corpus: the embedded-corpus tokenizer (2,048 tokens)",
        metavar="DIR|corpus",
    )
    attn_implementation: str | None = flag(
        None,
        "attention kernel (default: the checkpoint directory's config.json setting, else sdpa)",
        choices=("sdpa", "eager", "flash_attention_2"),
    )


@dataclass
class DataFlags:
    """Where the records come from, their format, packing and the held-out part."""

    data: str | None = flag(
        None,
        "training data: .txt, .jsonl, .json, .parquet or a datasets.save_to_disk directory, read "
        "through datasets; records of text, chat messages, prompt/completion, prompt/chosen/rejected "
        "preference pairs or prompt/completions/rewards rollouts (--objective) (default: the embedded corpus)",
    )
    data_format: str | None = flag(
        None,
        "the records' format (default: told from the first record: 'chosen' and 'rejected' -> "
        "preference, 'completions' or 'completion_ids' -> rollouts, 'completion' and 'label' -> unpaired, "
        "'messages' -> chat, 'prompt' and 'completion' -> prompt-completion, 'text' -> text)",
        choices=DATA_FORMATS,
    )
    loss_on: str | None = flag(
        None,
        "the tokens the loss is computed on (default: answers -- the assistant turns or the completion "
        "-- for chat and prompt-completion, all for text)",
        choices=("all", "answers"),
    )
    chat_template: str | None = flag(
        None,
        "Jinja chat template for chat records (default: the tokenizer's own; chatml: the built-in "
        "ChatML one, for tokenizers without a template such as the presets')",
        metavar="FILE|chatml",
    )
    packing: str | None = flag(
        None,
        "concat: records back to back (EOS after text and completions), crossing blocks; docs: "
        "positions restart and attention is masked at each record, and chat / prompt-completion "
        "records are never split (whole records per block, then padding); none: one record per block, "
        "padded (default: none for preference pairs and rollouts, which are padded rows, else concat)",
        choices=("concat", "docs", "none"),
    )
    drop_long: bool = flag(
        False,
        "leave out chat / prompt-completion records longer than --seq-len (default: cut them to it) "
        "under --packing docs / none",
    )
    data_workers: int = flag(1, "processes that tokenise the data", metavar="N")
    stream_above: str = flag(
        "256MB",
        "stream a data file larger than SIZE (read and tokenised as the run goes, blocks shuffled in a "
        "window, memory flat) instead of tokenising it whole first; 'never' to always tokenise whole",
        metavar="SIZE",
    )
    eval_data: str | None = flag(None, "evaluation data (same formats as --data)", metavar="FILE")
    eval_fraction: float = flag(
        0.0, "hold out this fraction of --data's records (seeded by --seed) for evaluation", metavar="F"
    )


@dataclass
class ObjectiveFlags:
    """The loss and how a step averages it."""

    objective: str | None = flag(
        None,
        "the loss (sets the ds_config's dhelix.objective.name; default: its value, else "
        "cross_entropy): dpo, ipo, simpo and orpo train on preference pairs (--data with prompt / "
        "chosen / rejected); dpo and ipo compare with the reference model: ref_chosen_logps / "
        "ref_rejected_logps in the data, or under LoRA the model with the adapter off; kto trains on "
        "unpaired completions (prompt / completion / label); grpo updates the "
        "policy on rollouts (prompt / completions / rewards); its other settings in dhelix.objective",
        choices=OBJECTIVES,
    )
    beta: float | None = flag(
        None,
        "the objective's beta (dhelix.objective.beta; default 0.1, simpo 2.0; grpo: the KL coefficient, default 0)",
    )
    loss_average: str | None = flag(
        None,
        "a step's loss: tokens -- its summed loss over its target count on every data-parallel "
        "replica, like the HF Trainer's num_items_in_batch; microbatches -- the mean of its micro-batch "
        "means (default: tokens when the loss is on the answers, whose count varies by micro-batch; "
        "microbatches otherwise)",
        choices=LOSS_AVERAGES,
    )


@dataclass
class CheckpointFlags:
    """DeepSpeed checkpoints, resume and stops."""

    ds_checkpoint: str | None = flag(
        None,
        "DeepSpeed checkpoints go here (at the end, every --save-interval steps, on a stop)",
        metavar="DIR",
    )
    save_interval: int = flag(0, "save a checkpoint every K steps (0: off)", metavar="K", check=at_least(0, "(0: off)"))
    keep_checkpoints: int = flag(2, "complete checkpoints kept (newest)", metavar="N", check=at_least(1))
    resume: str | None = flag(
        None,
        "continue from a checkpoint (a --ds-checkpoint dir or one of its tags); auto: the newest "
        "complete one under --ds-checkpoint, if any",
        metavar="DIR|auto",
    )
    allow_resume_change: bool = flag(
        False,
        "resume although the run differs from the checkpoint's: total steps (the LR schedule is "
        "stretched to them), LR schedule, optimizer settings, data, sequence length, seed, clipping, micro-batch "
        "and GAS; another TP/DP/EP/CP layout, ZeRO stage or fp16/bf16 (the checkpoint is resharded). Never "
        "another model, optimizer type, pipeline size or global batch",
    )
    stop_after: int = flag(
        0,
        "leave after N steps of this process with a checkpoint (a job slot's time limit); the "
        "run's schedule stays --steps long, --resume auto continues it (0: off)",
        metavar="N",
        check=at_least(0, "(0: off)"),
    )
    save_on_signal: bool = flag(
        False, "on SIGTERM/SIGINT (or a vanished launcher) finish the step and save a checkpoint first"
    )


@dataclass
class OutputFlags:
    """The HF checkpoint (or PEFT adapter) the run writes."""

    output_dir: str = flag("outputs/run", "where the HF checkpoint goes")
    overwrite_output_dir: bool = flag(
        False,
        "replace a regular file or a foreign non-empty directory at --output-dir; let checkpoints "
        "go into a non-empty directory at --ds-checkpoint",
    )
    max_shard_size: str = flag(
        "5GB",
        "largest safetensors file of the HF export (e.g. 500MB, 5GB); bigger models get shards and an index file",
    )


def _lora_dropout(value) -> str | None:
    return None if value is None or 0 <= value < 1 else f"must be in [0, 1), got {value}"


@dataclass
class LoraFlags:
    """A LoRA adapter instead of a full fine-tune."""

    lora: bool = flag(
        False,
        "train a LoRA adapter on the frozen model (rank --lora-r); the output is a PEFT adapter "
        "directory (adapter_config.json, adapter_model.safetensors)",
    )
    lora_r: int | None = flag(None, "LoRA rank (implies --lora; default 8)", metavar="R", check=at_least(1))
    lora_alpha: float | None = flag(None, "LoRA alpha (default 2 x rank)", check=above(0))
    lora_dropout: float | None = flag(
        None,
        "dropout on each adapter's input while training (default 0; masks drawn from --seed per "
        "micro-batch, so SI stays bitwise the sequential schedule)",
        metavar="P",
        check=_lora_dropout,
    )
    lora_targets: str | None = flag(
        None,
        "comma-separated module names LoRA wraps (default: every attention and MLP projection of the model's family)",
        metavar="NAMES",
    )
    peft_config: str | None = flag(
        None,
        "a PEFT LoRA adapter_config.json (instead of --lora-r / --lora-alpha / --lora-targets)",
        metavar="FILE",
    )
    merge_lora: bool = flag(False, "with LoRA: write the merged model as an HF checkpoint instead of the adapter")

    @property
    def asked(self) -> bool:
        """LoRA is on: --lora, --lora-r or --peft-config."""
        return self.lora or self.lora_r is not None or self.peft_config is not None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


@dataclass
class RunOptions:
    """Everything train.py's command line says: the run's own flags and one group per concern."""

    deepspeed: str = flag(
        None,
        'ds_config JSON (with an optional "dhelix" section)',
        aliases=("--deepspeed_config",),
        required=True,
    )
    steps: int = flag(100, "total optimizer steps of the run (a resume continues to it)", check=at_least(1))
    seq_len: int = flag(128, "tokens per sequence", check=at_least(1))
    seed: int = flag(1234, "model init, data order, and dhelix.seed (dropout masks) unless the section sets it")
    eval_interval: int = flag(
        0,
        "evaluate every K steps and after the last (Eval/loss; default with evaluation data: at the end only)",
        metavar="K",
        check=at_least(0, "(0: at the end only)"),
    )
    watchdog_s: float | None = flag(
        None,
        "seconds without progress before a rank reports where it hangs and exits (default: the "
        "config's dhelix.watchdog_s, 600)",
        check=above(0),
    )
    json_summary: str | None = flag(
        None,
        "write the run summary as JSON (start_step, per-step losses and lrs, timings, probe loss, per-rank memory)",
    )
    local_rank: int = flag(
        0,
        "set by the DeepSpeed launcher (default: $LOCAL_RANK, else 0)",
        name="--local_rank",
        env_default=_local_rank,
    )
    model: ModelFlags = group(ModelFlags, "model")
    data: DataFlags = group(DataFlags, "data")
    objective: ObjectiveFlags = group(ObjectiveFlags, "objective")
    checkpoints: CheckpointFlags = group(CheckpointFlags, "checkpoints, resume and stops")
    output: OutputFlags = group(OutputFlags, "output")
    lora: LoraFlags = group(LoraFlags, "LoRA")


def build_parser() -> StrictParser:
    """train.py's parser, built from ``RunOptions`` (the CLI reference in the docs is generated from it)."""
    parser = StrictParser(prog=PROG, description=DESCRIPTION)
    add_flags(parser, RunOptions)
    return parser


def parse_options(argv=None) -> RunOptions:
    """``RunOptions`` from a command line (argparse's own errors exit 2 with ``train.py: error:``)."""
    return from_namespace(RunOptions, build_parser().parse_args(argv))


def check_options(options: RunOptions) -> None:
    """The checks that need nothing but the flags: each field's own (``--steps must be >= 1``), then
    the ones between flags. One ``ValueError`` line naming the flag."""
    check_flags(options)
    c = options.checkpoints
    for name, on in (
        ("--save-interval", c.save_interval > 0),
        ("--save-on-signal", c.save_on_signal),
        ("--stop-after", c.stop_after > 0),
        ("--resume auto", c.resume == "auto"),
    ):
        if on and not c.ds_checkpoint:
            raise ValueError(f"{name} needs --ds-checkpoint DIR (where the checkpoints go)")
    for name, path in (("--data", options.data.data), ("--eval-data", options.data.eval_data)):
        if path is not None:
            from ..data.records import data_kind

            try:
                data_kind(path)  # missing, a foreign directory, an unknown suffix: one line naming it
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
    if options.eval_interval and not (options.data.eval_data or options.data.eval_fraction):
        raise ValueError("--eval-interval evaluates on --eval-data FILE or --eval-fraction F of --data: give one")
    _check_lora_flags(options.lora)


def _check_lora_flags(lora: LoraFlags) -> None:
    given = [f for f, v in (("--lora-alpha", lora.lora_alpha), ("--lora-targets", lora.lora_targets)) if v is not None]
    given += ["--lora-dropout"] if lora.lora_dropout is not None else []
    if not lora.asked and (given or lora.merge_lora):
        raise ValueError(f"{(given + ['--merge-lora'])[0]} sets up LoRA: add --lora (or --lora-r R)")
    if lora.peft_config is not None and (lora.lora_r is not None or given):
        raise ValueError(
            "--peft-config gives the whole LoRA config: drop --lora-r / --lora-alpha / --lora-targets / --lora-dropout"
        )
