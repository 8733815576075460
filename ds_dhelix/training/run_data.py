"""The run's tokenizer and data from the data flags, checked against the layout and the objective
before any model is built.

    resolve_packing(options)        --packing's default from the data's format
    data_options(options, tok)      the flags as ``ds_dhelix.data.DataOptions``
    load_run_data(options, ...)     (tokenizer, TrainingData, options): enough blocks for a step on
                                    every replica, the records the objective trains on
"""

from __future__ import annotations

import dataclasses
import os

from .options import RunOptions, say

OBJECTIVE_DATA = {
    "preference": "preference pairs (prompt / chosen / rejected)",
    "unpaired": "unpaired completions (prompt / completion / label)",
    "rollouts": "rollouts (prompt / completions / rewards)",
}


def resolve_packing(options: RunOptions) -> RunOptions:
    """--packing's default filled in: none (padded rows) for preference pairs and rollouts, else concat."""
    if options.data.packing is not None:
        return options
    return dataclasses.replace(options, data=dataclasses.replace(options.data, packing=_default_packing(options.data)))


def _default_packing(data) -> str:
    from ..data.records import ROW_FORMATS, detect_format, first_record, open_records

    if data.data_format is not None:
        return "none" if data.data_format in ROW_FORMATS else "concat"
    if data.data is None:
        return "concat"
    try:
        first = first_record(open_records(os.path.expanduser(data.data), streaming=True))
        return "none" if detect_format(first, data.data) in ROW_FORMATS else "concat"
    except Exception:  # noqa: BLE001 - unreadable data: reading it whole later names the problem
        return "concat"


def data_options(options: RunOptions, tokenizer=None, **changes):
    """The ``DataOptions`` of the data flags, checked (``tokenizer``: for its padding id;
    ``changes``: fields a script sets itself)."""
    from ..data.sources import DataOptions, parse_size

    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    d = options.data
    values = {
        "path": d.data,
        "fmt": d.data_format,
        "loss_on": d.loss_on,
        "chat_template": d.chat_template,
        "packing": d.packing,
        "seq_len": options.seq_len,
        "drop_long": d.drop_long,
        "workers": d.data_workers,
        "stream_above": parse_size(d.stream_above),
        "eval_path": d.eval_data,
        "eval_fraction": d.eval_fraction,
        "seed": options.seed,
        "pad_id": pad,
    }
    result = DataOptions(**{**values, **changes})
    result.check()
    return result


def load_run_data(options: RunOptions, setup, model_config, lora=None):
    """``(tokenizer, data, options)``: the tokenizer, the run's data (``ds_dhelix.data.load_data``) —
    what the objective trains on, enough blocks for one step on every replica and for one
    evaluation micro-batch — and the options with the loss average the objective implies."""
    from hf_models.registry import load_tokenizer_for

    from ..data.sources import load_data

    tokenizer = load_tokenizer_for(options.model.model, tokenizer=options.model.tokenizer)
    _say_borrowed_tokenizer(options, len(tokenizer))
    vocab = getattr(model_config, "vocab_size", None)  # (every data path refuses an id beyond it)
    given = data_options(options, tokenizer, scale_rewards=setup.dh.objective.scale_rewards, vocab_size=vocab)
    data = load_data(given, tokenizer)
    options = check_objective_data(options, setup, data, lora)
    if options.data.chat_template is not None:  # (chat data only: load_data refuses it otherwise)
        from ..data.records import resolve_chat_template

        # what the model was trained on is what the exported tokenizer renders
        tokenizer.chat_template = resolve_chat_template(tokenizer, options.data.chat_template)
    _check_enough(options, setup, data)
    if data.stats.truncated:
        say(
            f"{data.stats.truncated} of {data.stats.records} records are longer than --seq-len "
            f"{options.seq_len} and were cut to it (--drop-long leaves them out)"
        )
    from hf_models.adapters import is_moe

    if is_moe(model_config) and data.stats.padding_tokens:
        say(
            f"{data.stats.padding_fraction:.1%} of the tokens are padding, which the MoE router's "
            f"load-balancing loss counts (as HF's does without an attention mask)"
        )
    return tokenizer, data, options


def _say_borrowed_tokenizer(options: RunOptions, size: int) -> None:
    """A checkpoint directory without tokenizer files trains with the embedded-corpus tokenizer (its
    vocabulary fits): said on the run's first lines, since the export carries that tokenizer."""
    from hf_models.registry import TOKENIZER_FILES, is_preset

    name = options.model.model
    if options.model.tokenizer is not None or is_preset(name):
        return
    path = os.path.expanduser(name)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        say(
            f"{name} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): the run tokenises with the "
            f"embedded-corpus tokenizer ({size:,} tokens), and the export carries it; give --tokenizer DIR "
            f"for the one the model was trained with"
        )


def _check_enough(options: RunOptions, setup, data) -> None:
    """One micro-batch on every data-parallel replica, for training and for evaluation."""
    micro, dp = setup.batch.micro_batch_size, setup.dims.dp
    need = micro * dp
    if data.train is not None and len(data.train) < need:
        s = data.stats
        dropped = f", {s.dropped} left out as longer (--drop-long)" if s.dropped else ""
        blocks = {"preference": "preference pairs", "unpaired": "completions", "rollouts": "completions"}
        blocks = blocks.get(data.format, "blocks")
        raise ValueError(
            f"{options.data.data or 'the corpus'} has {s.tokens} tokens in {s.records} records{dropped}: "
            f"{len(data.train)} {blocks} of --seq-len {options.seq_len} (--packing {options.data.packing}), fewer "
            f"than one micro-batch ({micro}) on each of {dp} data-parallel replicas; use more data or a "
            f"shorter --seq-len"
        )
    if data.streaming:
        try:
            data.first_batch(need)  # the stream's first blocks (a look: the run reads it again)
        except ValueError as err:
            raise ValueError(
                f"{options.data.data}: {err}, one micro-batch ({micro}) on each of "
                f"{dp} data-parallel replicas; use more data or a shorter --seq-len"
            ) from None
    if data.eval is not None and len(data.eval) < need:
        raise ValueError(
            f"the evaluation data packs into {len(data.eval)} blocks, fewer than one micro-batch "
            f"({micro}) on each of {dp} data-parallel replicas"
        )


def check_objective_data(options: RunOptions, setup, data, lora) -> RunOptions:
    """The objective and the data agree: preference pairs for a paired objective (with their
    reference log-probabilities unless LoRA lets the engine compute them), rollouts for grpo,
    other data for cross-entropy; the step's average fits the objective (returned filled in)."""
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
        _check_pairs(options, setup, objective, data, lora)
    elif wants == "rollouts":
        average = _check_rollouts(options, objective, data)
        return dataclasses.replace(options, objective=dataclasses.replace(options.objective, loss_average=average))
    return options


def _check_pairs(options: RunOptions, setup, objective, data, lora) -> None:
    if options.objective.loss_average == "tokens":
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


def _check_rollouts(options: RunOptions, objective, data) -> str:
    """GRPO: the step's average is its loss_type's (dapo: over the step's tokens on every replica;
    the others: the mean of the micro-batches'), returned; its KL term needs the reference's
    log-probabilities."""
    average = "tokens" if objective.loss_type == "dapo" else "microbatches"
    given = options.objective.loss_average
    if given not in (None, average):
        raise ValueError(
            f"--loss-average {given} with grpo's loss_type {objective.loss_type!r}, which averages over "
            f"{'the step' if average == 'tokens' else 'each micro-batch'}: drop the flag (or choose another loss_type)"
        )
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
    return average
