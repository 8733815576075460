"""Fine-tune an HF causal LM with DeepSpeed (+ ds_dhelix when the ds_config enables it).

    deepspeed --num_gpus 2 train.py --deepspeed ds_configs/tiny_llama_cpu.json

On a machine without GPUs DeepSpeed's CPU accelerator runs the ranks over gloo. Everything the run
needs is checked before any model is built; bad input gets one line of error and exit code 2.
``--steps`` is the run's total: a resumed run continues from the checkpoint's step to it.

This script checks the flags and wires them to the package: the training loop, evaluation, the
resume contract and the summary are ``ds_dhelix.training``'s (a script of your own can call them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (the CLI reference in the docs is generated from this parser)."""
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--deepspeed",
        "--deepspeed_config",
        dest="deepspeed",
        required=True,
        help='ds_config JSON (with an optional "dhelix" section)',
    )
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="preset (tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-gemma3, tiny-phi3, tiny-smollm3, "
        "tiny-olmo3, tiny-gpt2, tiny-gpt-neox; MoE tiny-phimoe, tiny-mixtral, tiny-qwen3-moe, "
        "tiny-qwen2-moe, tiny-olmoe, tiny-deepseek-v3, tiny-glm4-moe, tiny-gpt-oss, tiny-qwen3-moe-mixed; small-llama, "
        "small-phimoe: ~100M) or a local HF checkpoint dir "
        "(each rank reads only its shards under dhelix)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|corpus",
        help="tokenizer directory (default: the checkpoint's own, the embedded-corpus tokenizer for presets; a "
        "checkpoint without tokenizer files and a vocabulary larger than the embedded tokenizer's is refused); "
        "corpus: the embedded-corpus tokenizer (2,048 tokens)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="training data: .txt, .jsonl, .json, .parquet or a datasets.save_to_disk directory, read "
        "through datasets; records of text, chat messages, prompt/completion, prompt/chosen/rejected "
        "preference pairs or prompt/completions/rewards rollouts (--objective) (default: the embedded corpus)",
    )
    p.add_argument(
        "--data-format",
        default=None,
        choices=["text", "chat", "prompt-completion", "preference", "unpaired", "rollouts"],
        help="the records' format (default: told from the first record: 'chosen' and 'rejected' -> "
        "preference, 'completions' or 'completion_ids' -> rollouts, 'completion' and 'label' -> unpaired, "
        "'messages' -> chat, 'prompt' and 'completion' -> prompt-completion, 'text' -> text)",
    )
    p.add_argument(
        "--loss-on",
        default=None,
        choices=["all", "answers"],
        help="the tokens the loss is computed on (default: answers -- the assistant turns or the completion "
        "-- for chat and prompt-completion, all for text)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|chatml",
        help="Jinja chat template for chat records (default: the tokenizer's own; chatml: the built-in "
        "ChatML one, for tokenizers without a template such as the presets')",
    )
    p.add_argument(
        "--loss-average",
        default=None,
        choices=["tokens", "microbatches"],
        help="a step's loss: tokens -- its summed loss over its target count on every data-parallel "
        "replica, like the HF Trainer's num_items_in_batch; microbatches -- the mean of its micro-batch "
        "means (default: tokens when the loss is on the answers, whose count varies by micro-batch; "
        "microbatches otherwise)",
    )
    p.add_argument(
        "--packing",
        default=None,
        choices=["concat", "docs", "none"],
        help="concat: records back to back (EOS after text and completions), crossing blocks; docs: "
        "positions restart and attention is masked at each record, and chat / prompt-completion "
        "records are never split (whole records per block, then padding); none: one record per block, "
        "padded (default: none for preference pairs and rollouts, which are padded rows, else concat)",
    )
    p.add_argument(
        "--objective",
        default=None,
        choices=["cross_entropy", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"],
        help="the loss (sets the ds_config's dhelix.objective.name; default: its value, else "
        "cross_entropy): dpo, ipo, simpo and orpo train on preference pairs (--data with prompt / "
        "chosen / rejected); dpo and ipo compare with the reference model: ref_chosen_logps / "
        "ref_rejected_logps in the data, or under LoRA the model with the adapter off; kto trains on "
        "unpaired completions (prompt / completion / label); grpo updates the "
        "policy on rollouts (prompt / completions / rewards); its other settings in dhelix.objective",
    )
    p.add_argument(
        "--beta",
        type=float,
        default=None,
        help="the objective's beta (dhelix.objective.beta; default 0.1, simpo 2.0; grpo: the KL coefficient, default 0)",
    )
    p.add_argument(
        "--drop-long",
        action="store_true",
        help="leave out chat / prompt-completion records longer than --seq-len (default: cut them to it) "
        "under --packing docs / none",
    )
    p.add_argument("--data-workers", type=int, default=1, metavar="N", help="processes that tokenise the data")
    p.add_argument(
        "--stream-above",
        default="256MB",
        metavar="SIZE",
        help="stream a data file larger than SIZE (read and tokenised as the run goes, blocks shuffled in a "
        "window, memory flat) instead of tokenising it whole first; 'never' to always tokenise whole",
    )
    p.add_argument("--eval-data", default=None, metavar="FILE", help="evaluation data (same formats as --data)")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this fraction of --data's records (seeded by --seed) for evaluation",
    )
    p.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        metavar="K",
        help="evaluate every K steps and after the last (Eval/loss; default with evaluation data: at the end only)",
    )
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps of the run (a resume continues to it)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--output-dir", default="outputs/run", help="where the HF checkpoint goes")
    p.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="replace a regular file or a foreign non-empty directory at --output-dir; let checkpoints "
        "go into a non-empty directory at --ds-checkpoint",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="model init, data order, and dhelix.seed (dropout masks) unless the section sets it",
    )
    p.add_argument(
        "--ds-checkpoint",
        default=None,
        metavar="DIR",
        help="DeepSpeed checkpoints go here (at the end, every --save-interval steps, on a stop)",
    )
    p.add_argument("--save-interval", type=int, default=0, metavar="K", help="save a checkpoint every K steps (0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="N", help="complete checkpoints kept (newest)")
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR|auto",
        help="continue from a checkpoint (a --ds-checkpoint dir or one of its tags); auto: the newest "
        "complete one under --ds-checkpoint, if any",
    )
    p.add_argument(
        "--allow-resume-change",
        action="store_true",
        help="resume although the run differs from the checkpoint's: total steps (the LR schedule is "
        "stretched to them), LR schedule, optimizer settings, data, sequence length, seed, clipping, micro-batch "
        "and GAS; another TP/DP/EP/CP layout, ZeRO stage or fp16/bf16 (the checkpoint is resharded). Never "
        "another model, optimizer type, pipeline size or global batch",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="N",
        help="leave after N steps of this process with a checkpoint (a job slot's time limit); the "
        "run's schedule stays --steps long, --resume auto continues it (0: off)",
    )
    p.add_argument(
        "--save-on-signal",
        action="store_true",
        help="on SIGTERM/SIGINT (or a vanished launcher) finish the step and save a checkpoint first",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=None,
        help="seconds without progress before a rank reports where it hangs and exits (default: the "
        "config's dhelix.watchdog_s, 600)",
    )
    p.add_argument(
        "--attn-implementation",
        default=None,
        choices=["sdpa", "eager", "flash_attention_2"],
        help="attention kernel (default: the checkpoint directory's config.json setting, else sdpa)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file of the HF export (e.g. 500MB, 5GB); bigger models get shards and an index file",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter on the frozen model (rank --lora-r); the output is a PEFT adapter "
        "directory (adapter_config.json, adapter_model.safetensors)",
    )
    p.add_argument("--lora-r", type=int, default=None, metavar="R", help="LoRA rank (implies --lora; default 8)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        metavar="P",
        help="dropout on each adapter's input while training (default 0; masks drawn from --seed per "
        "micro-batch, so SI stays bitwise the sequential schedule)",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated module names LoRA wraps (default: every attention and MLP projection of the "
        "model's family)",
    )
    p.add_argument(
        "--peft-config",
        default=None,
        metavar="FILE",
        help="a PEFT LoRA adapter_config.json (instead of --lora-r / --lora-alpha / --lora-targets)",
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="with LoRA: write the merged model as an HF checkpoint instead of the adapter",
    )
    p.add_argument(
        "--json-summary",
        default=None,
        help="write the run summary as JSON (start_step, per-step losses and lrs, timings, probe "
        "loss, per-rank memory)",
    )
    p.add_argument(
        "--local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by the DeepSpeed launcher (default: $LOCAL_RANK, else 0)",
    )
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
    from ds_dhelix.config.section import load_ds_config
    from ds_dhelix.engine.build import check_setup
    from hf_models.registry import check_weight_files, is_preset, load_config

    _check_flags(args)
    ds_config = load_ds_config(args.deepspeed)
    if args.watchdog_s is not None:
        if not (ds_config.get("dhelix") or {}).get("enabled"):
            raise ValueError(
                "--watchdog-s sets the ds_dhelix engine's watchdog; this ds_config does not enable "
                "dhelix (plain DeepSpeed has none)"
            )
        ds_config["dhelix"]["watchdog_s"] = args.watchdog_s
    if (ds_config.get("dhelix") or {}).get("enabled"):
        ds_config["dhelix"].setdefault("seed", args.seed)  # dropout masks and router noise follow --seed
    _set_objective(args, ds_config)
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
        raise ValueError(
            'the ds_config has no "optimizer" section: train.py trains, so it needs one '
            '(e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}})'
        )
    _check_lengths(args, setup, model_config)
    _check_outputs(args)
    set_schedule_length(ds_config, args.steps)
    lora = lora_config(args, setup, model_config)
    tokenizer, data = _data(args, setup, model_config, lora)
    from ds_dhelix.training import adapter_state, resume_point, run_state

    state = run_state(ds_config, setup, data, args.model, args.steps, args.loss_average, adapter_state(lora))
    resume = resume_point(args.resume, args.ds_checkpoint, state, args.allow_resume_change, prog="train.py")
    return Prepared(ds_config, setup, tokenizer, data, state, resume, lora=lora)


def lora_config(args, setup, model_config):
    """The LoraConfig of --lora / --lora-r / --peft-config, checked against the model's family
    before any model is built; None for a full fine-tune."""
    asked = lora_asked(args)
    given = [
        f
        for f, v in (
            ("--lora-alpha", args.lora_alpha),
            ("--lora-targets", args.lora_targets),
            ("--lora-dropout", args.lora_dropout),
        )
        if v is not None
    ]
    if not asked:
        if given or args.merge_lora:
            raise ValueError(f"{(given + ['--merge-lora'])[0]} sets up LoRA: add --lora (or --lora-r R)")
        return None
    if not setup.dh.enabled:
        raise ValueError("--lora trains through the ds_dhelix engine: enable the ds_config's dhelix section")
    from peft import LoraConfig

    from hf_models.adapters import check_lora_targets, lora_target_names
    from hf_models.lora import check_config

    if args.peft_config is not None:
        if args.lora_r is not None or given:
            raise ValueError(
                "--peft-config gives the whole LoRA config: drop --lora-r / --lora-alpha / --lora-targets / --lora-dropout"
            )
        try:
            with open(os.path.expanduser(args.peft_config)) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--peft-config {args.peft_config!r}: {err}") from None
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(
                f"--peft-config {args.peft_config!r} is a {raw['peft_type']} adapter; ds_dhelix trains LoRA"
            )
        known = set(LoraConfig.__dataclass_fields__)
        dropped = sorted(set(raw) - known)
        if dropped and int(os.environ.get("RANK", 0)) == 0:
            print(
                f"train.py: --peft-config keys this PEFT's LoraConfig does not know, not used: {', '.join(dropped)}",
                file=sys.stderr,
            )
        cfg = LoraConfig(**{k: v for k, v in raw.items() if k in known and k != "peft_type"})
        if cfg.init_lora_weights is not True:  # (the engine's own check comes after the model is built)
            raise ValueError(
                f"--peft-config {args.peft_config!r}: init_lora_weights={cfg.init_lora_weights!r}; train.py builds "
                f"the model empty and reads each rank's shards, then draws the factors as PEFT's default "
                f"does (A Kaiming-uniform, B zero): use init_lora_weights true"
            )
    else:
        r = 8 if args.lora_r is None else args.lora_r
        if r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {r}")
        if args.lora_alpha is not None and not args.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
        targets = None if args.lora_targets is None else [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        targets = check_lora_targets(model_config, targets, "--lora-targets")
        dropout = args.lora_dropout or 0.0
        if not 0 <= dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout}")
        cfg = LoraConfig(r=r, lora_alpha=args.lora_alpha or 2 * r, target_modules=targets, lora_dropout=dropout)
    check_config(cfg)
    names = cfg.target_modules
    if not names or isinstance(names, str) and names != "all-linear":
        raise ValueError(
            f"LoRA target_modules {names!r}: give a list of module names, from: "
            f"{', '.join(lora_target_names(model_config))}"
        )
    if not isinstance(names, str):
        check_lora_targets(model_config, names)
    return cfg


def _set_objective(args, ds_config) -> None:
    """--objective / --beta into the ds_config's dhelix.objective (the engine's loss)."""
    given = [f for f, v in (("--objective", args.objective), ("--beta", args.beta)) if v is not None]
    if not given:
        return
    if not (ds_config.get("dhelix") or {}).get("enabled"):
        raise ValueError(f"{given[0]} sets the ds_dhelix engine's loss: enable the ds_config's dhelix section")
    section = ds_config["dhelix"].setdefault("objective", {})
    if args.objective is not None:
        section["name"] = args.objective
    if args.beta is not None:
        section["beta"] = args.beta


OBJECTIVE_DATA = {
    "preference": "preference pairs (prompt / chosen / rejected)",
    "unpaired": "unpaired completions (prompt / completion / label)",
    "rollouts": "rollouts (prompt / completions / rewards)",
}


def _check_objective_data(args, setup, data, lora) -> None:
    """The objective and the data agree: preference pairs for a paired objective (with their
    reference log-probabilities unless LoRA lets the engine compute them), rollouts for grpo,
    other data for cross-entropy; the step's average fits the objective."""
    objective = setup.dh.objective
    wants = "preference" if objective.paired else {"grpo": "rollouts", "kto": "unpaired"}.get(objective.name)
    if data.format != wants and (wants or data.format in OBJECTIVE_DATA):
        if wants is None:
            fix = {"preference": "dpo, ipo, simpo or orpo", "unpaired": "kto", "rollouts": "grpo"}[data.format]
            raise ValueError(f"--data holds {OBJECTIVE_DATA[data.format]}: choose their objective (--objective {fix})")
        raise ValueError(
            f"objective {objective.name!r} trains on {OBJECTIVE_DATA[wants]}; --data holds {data.format} records"
        )
    if wants in ("preference", "unpaired"):
        _check_pairs(args, setup, objective, data, lora)
    elif wants == "rollouts":
        _check_rollouts(args, objective, data)


def _check_pairs(args, setup, objective, data, lora) -> None:
    if args.loss_average == "tokens":
        raise ValueError(
            "--loss-average tokens with a preference objective: its loss is a mean over pairs (or KTO's "
            "completions; each micro-batch holds the same number); drop the flag"
        )
    refs = "ref_logps" in data.train.fields
    if objective.name in ("dpo", "ipo", "kto") and not refs and setup.dims.pp > 1:
        raise ValueError(
            f"objective {objective.name!r} with a pipeline ({setup.dims.pp} stages) needs the reference "
            f"log-probabilities in the data (the pass with the LoRA adapter off runs on one-stage layouts only)"
        )
    if objective.name in ("dpo", "ipo", "kto") and not refs and lora is None:
        columns = "ref_logps / ref_KL_logps" if objective.name == "kto" else "ref_chosen_logps / ref_rejected_logps"
        raise ValueError(
            f"objective {objective.name!r} compares with the reference model, and a full fine-tune changes the "
            f"only copy of its weights: give {columns} in the data (as TRL precomputes them), or train LoRA "
            f"(--lora: the reference is the model with the adapter off)"
        )
    if refs and objective.name in ("simpo", "orpo"):
        raise ValueError(
            f"objective {objective.name!r} uses no reference model; the data's ref_chosen_logps / "
            f"ref_rejected_logps would not be read: drop them or choose dpo / ipo"
        )


def _check_rollouts(args, objective, data) -> None:
    """GRPO: the step's average is its loss_type's (dapo: over the step's tokens on every replica;
    the others: the mean of the micro-batches'); its KL term needs the reference's log-probabilities."""
    average = "tokens" if objective.loss_type == "dapo" else "microbatches"
    if args.loss_average not in (None, average):
        raise ValueError(
            f"--loss-average {args.loss_average} with grpo's loss_type {objective.loss_type!r}, which averages over "
            f"{'the step' if average == 'tokens' else 'each micro-batch'}: drop the flag (or choose another loss_type)"
        )
    args.loss_average = average
    refs = "ref_token_logps" in data.train.fields
    if objective.default_beta and not refs:
        raise ValueError(
            f"grpo with beta {objective.default_beta} (the KL term) needs the reference's per-token "
            f"log-probabilities: give ref_logps (with prompt_ids / completion_ids) in the data, or beta 0"
        )
    if refs and not objective.default_beta:
        raise ValueError(
            "the data's ref_logps would not be read: grpo's beta is 0 (no KL term); set --beta (e.g. 0.04) or drop them"
        )


def _default_packing(args) -> str:
    """--packing's default: none (padded rows) for preference pairs and rollouts, else concat."""
    from ds_dhelix.data.records import ROW_FORMATS, detect_format, first_record, open_records

    if args.data_format is not None:
        return "none" if args.data_format in ROW_FORMATS else "concat"
    if args.data is None:
        return "concat"
    try:
        first = first_record(open_records(os.path.expanduser(args.data), streaming=True))
        return "none" if detect_format(first, args.data) in ROW_FORMATS else "concat"
    except Exception:  # noqa: BLE001 - unreadable data: reading it whole later names the problem
        return "concat"


def lora_asked(args) -> bool:
    return args.lora or args.lora_r is not None or args.peft_config is not None


def _check_flags(args) -> None:
    for name in ("steps", "seq_len", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("save_interval", "stop_after"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(args, name)}")
    if args.watchdog_s is not None and not args.watchdog_s > 0:
        raise ValueError(f"--watchdog-s must be > 0, got {args.watchdog_s}")
    for flag, on in (
        ("--save-interval", args.save_interval > 0),
        ("--save-on-signal", args.save_on_signal),
        ("--stop-after", args.stop_after > 0),
        ("--resume auto", args.resume == "auto"),
    ):
        if on and not args.ds_checkpoint:
            raise ValueError(f"{flag} needs --ds-checkpoint DIR (where the checkpoints go)")
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None:
            from ds_dhelix.data.records import data_kind

            try:
                data_kind(path)  # missing, a foreign directory, an unknown suffix: one line naming it
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    if args.packing is None:
        args.packing = _default_packing(args)
    data_options(args)  # the data flags' own values
    if args.eval_interval < 0:
        raise ValueError(f"--eval-interval must be >= 0 (0: at the end only), got {args.eval_interval}")
    if args.eval_interval and not (args.eval_data or args.eval_fraction):
        raise ValueError("--eval-interval evaluates on --eval-data FILE or --eval-fraction F of --data: give one")


def _check_packing(args, setup, model_config) -> None:
    from hf_models.adapters import is_moe

    objective_rows = setup.dh.objective.name != "cross_entropy"  # (pairs and rollouts are padded rows)
    if args.packing == "none" and setup.dh.enabled and is_moe(model_config) and not objective_rows:
        raise ValueError(
            "--packing none pads documents, and the MoE router's load-balancing loss would count the "
            "padded tokens (HF leaves them out); use --packing docs (or concat) with an MoE model"
        )
    if args.packing == "docs" and args.attn_implementation == "flash_attention_2":
        raise ValueError(
            "--packing docs masks attention across documents, which the ds_dhelix graph does not yet "
            "pass to flash_attention_2; use sdpa or eager"
        )
    from hf_models.adapters import check_packing  # the family's own (Gated DeltaNet layers: no packed documents;

    check_packing(model_config, args.packing)  # plain DeepSpeed's HF model would not keep them apart either)


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
            raise ValueError(
                f"--ds-checkpoint {ckpt!r} lies in --output-dir {out!r}: the HF export replaces that "
                f"directory whole, checkpoints included; give them separate paths"
            )
        if os.path.isfile(ckpt):
            raise ValueError(f"--ds-checkpoint {ckpt!r} is a regular file; checkpoints need a directory there")
        check_output_dir(ckpt, "--ds-checkpoint", args.overwrite_output_dir, ours=is_checkpoint_dir)
    if args.json_summary:
        folder = os.path.dirname(os.path.abspath(args.json_summary))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json-summary {args.json_summary!r}: {folder!r} is not a writable directory")


def _data(args, setup, model_config, lora=None):
    """The tokenizer and the run's data (``ds_dhelix.data.load_data``): what the objective trains on,
    enough blocks for one step on every replica, and for one evaluation micro-batch."""
    from ds_dhelix.data.sources import load_data
    from hf_models.registry import load_tokenizer_for

    tokenizer = load_tokenizer_for(args.model, tokenizer=args.tokenizer)
    options = data_options(args, tokenizer)
    options.scale_rewards = setup.dh.objective.scale_rewards  # (rollouts with rewards)
    data = load_data(options, tokenizer)
    _check_objective_data(args, setup, data, lora)
    if args.chat_template is not None:  # (chat data only: load_data refuses it otherwise)
        from ds_dhelix.data.records import resolve_chat_template

        # what the model was trained on is what the exported tokenizer renders
        tokenizer.chat_template = resolve_chat_template(tokenizer, args.chat_template)
    need, d = setup.batch.micro_batch_size * setup.dims.dp, setup.dims
    if data.train is not None and len(data.train) < need:
        s = data.stats
        dropped = f", {s.dropped} left out as longer (--drop-long)" if s.dropped else ""
        blocks = {"preference": "preference pairs", "unpaired": "completions", "rollouts": "completions"}
        blocks = blocks.get(data.format, "blocks")
        raise ValueError(
            f"{args.data or 'the corpus'} has {s.tokens} tokens in {s.records} records{dropped}: "
            f"{len(data.train)} {blocks} of --seq-len {args.seq_len} (--packing {args.packing}), fewer than one micro-batch "
            f"({setup.batch.micro_batch_size}) on each of {d.dp} data-parallel replicas; use more data or a "
            f"shorter --seq-len"
        )
    if data.streaming:
        try:
            data.first_batch(need)  # the stream's first blocks (a look: the run reads it again)
        except ValueError as err:
            raise ValueError(
                f"{args.data}: {err}, one micro-batch ({setup.batch.micro_batch_size}) on each of "
                f"{d.dp} data-parallel replicas; use more data or a shorter --seq-len"
            ) from None
    if data.eval is not None and len(data.eval) < need:
        raise ValueError(
            f"the evaluation data packs into {len(data.eval)} blocks, fewer than one micro-batch "
            f"({setup.batch.micro_batch_size}) on each of {d.dp} data-parallel replicas"
        )
    if data.stats.truncated and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"train.py: {data.stats.truncated} of {data.stats.records} records are longer than --seq-len "
            f"{args.seq_len} and were cut to it (--drop-long leaves them out)",
            file=sys.stderr,
        )
    from hf_models.adapters import is_moe

    if is_moe(model_config) and data.stats.padding_tokens and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"train.py: {data.stats.padding_fraction:.1%} of the tokens are padding, which the MoE router's "
            f"load-balancing loss counts (as HF's does without an attention mask)",
            file=sys.stderr,
        )
    return tokenizer, data


def data_options(args, tokenizer=None):
    """The ``DataOptions`` of the data flags (``tokenizer``: for its padding id)."""
    from ds_dhelix.data.sources import DataOptions, parse_size

    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = DataOptions(
        path=args.data,
        fmt=args.data_format,
        loss_on=args.loss_on,
        chat_template=args.chat_template,
        packing=args.packing,
        seq_len=args.seq_len,
        drop_long=args.drop_long,
        workers=args.data_workers,
        stream_above=parse_size(args.stream_above),
        eval_path=args.eval_data,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        pad_id=pad,
    )
    options.check()
    return options


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
            print(
                f"train.py: scheduler warmup_num_steps {warmup} shortened to {params['warmup_num_steps']} "
                f"(a fifth of --steps {steps})",
                file=sys.stderr,
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prep = check_inputs(args)
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:  # under the launcher every rank checks; one says why
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    return run(args, prep)


def run(args, prep: Prepared) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_dhelix.runtime.comm import CollectiveError, is_comm_failure
    from ds_dhelix.training import teardown

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    if dist.get_rank() == 0:
        print(prep.setup.batch.table())
    if args.ds_checkpoint and dist.get_rank() == 0:
        from ds_dhelix.engine.resume import remove_leftovers

        remove_leftovers(os.path.abspath(args.ds_checkpoint))
    try:
        engine = build(args, prep)
    except ValueError as err:  # a checkpoint that does not fit the model: every rank finds it
        if dist.get_rank() == 0:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
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
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=prep.ds_config)
    report = getattr(engine, "load_report", None)
    prep.memory = {
        "baseline_rss_mib": baseline,
        "load_peak_rss_mib": report.peak_rss_mib if report is not None else peak_rss_mib(),
        "shard_mib": sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20,
    }
    reset_peak_rss()  # the training peak is measured from here
    from ds_dhelix.training import resume_engine

    resume_engine(engine, prep.resume, prep.run_state, prog="train.py")
    return engine


def train(args, prep: Prepared, engine) -> int:
    """The training loop (``ds_dhelix.training.train_loop``) to ``--steps``; then the run's end:
    leave on a stop, the summary on --stop-after, else ``finish``."""
    import torch.distributed as dist

    from ds_dhelix.training import memory_marks, summarize, train_loop

    options = loop_options(args)
    log = train_loop(engine, prep.data, options, prep.run_state)
    if log.end == "stopped":
        sys.stdout.flush()
        os._exit(log.exit_code)  # every rank leaves at the same step boundary
    if log.end == "left":  # --stop-after: the checkpoint is saved; no export
        memory = memory_marks(engine, prep.memory)
        if dist.get_rank() == 0:
            summarize(log, engine, prep.data, options, **summary_fields(args), probe={}, memory=memory)
        return 0
    finish(args, prep, engine, log, options)
    return 0


def loop_options(args):
    """The loop's settings (``ds_dhelix.training.LoopOptions``) from the flags."""
    from ds_dhelix.training import LoopOptions

    return LoopOptions(
        steps=args.steps,
        eval_interval=args.eval_interval,
        loss_average=args.loss_average,
        checkpoint_dir=args.ds_checkpoint,
        save_interval=args.save_interval,
        keep_checkpoints=args.keep_checkpoints,
        stop_after=args.stop_after,
        save_on_signal=args.save_on_signal,
        prog="train.py",
    )


def summary_fields(args) -> dict:
    """The summary's fields that come from the flags (``ds_dhelix.training.summarize``)."""
    return {
        "model": args.model,
        "attn_implementation": args.attn_implementation,
        "json_path": args.json_summary,
        "export_label": "PEFT adapter" if lora_asked(args) and not args.merge_lora else "HF checkpoint",
    }


def finish(args, prep: Prepared, engine, log, options) -> None:
    """The final checkpoint, the HF export, the summary line and JSON (``log``: the loop's
    ``TrainLog``, ``options`` its ``LoopOptions``)."""
    import torch.distributed as dist

    from ds_dhelix.engine.evaluation import watched
    from ds_dhelix.training import flush_tensorboard, memory_marks, probe_loss, save_checkpoint, summarize

    probe = probe_loss(engine, prep.data)
    if args.ds_checkpoint and log.start_step < engine.global_steps:  # (a resume at the end only exports)
        save_checkpoint(engine, options, prep.run_state)
    with watched(engine, "HF export"):
        if prep.lora is not None and not args.merge_lora:
            path = engine.export_adapter(args.output_dir, base=prep.run_state["model"], tokenizer=prep.tokenizer)
        elif prep.setup.dh.enabled:  # (a LoRA model: merged)
            path = engine.export_hf(args.output_dir, prep.tokenizer, max_shard_size=args.max_shard_size)
        else:
            from ds_dhelix.engine.checkpoint import export_hf

            path = export_hf(engine.module, args.output_dir, prep.tokenizer, max_shard_size=args.max_shard_size)
    memory = memory_marks(engine, prep.memory)
    if dist.get_rank() == 0:
        summarize(log, engine, prep.data, options, **summary_fields(args), export=path, probe=probe, memory=memory)
    flush_tensorboard(engine)


if __name__ == "__main__":
    sys.exit(main())
