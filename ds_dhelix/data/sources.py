"""A run's data, from a path (or the embedded corpus) to micro-batches: read, format told,
encoded, packed, held out for evaluation; and what the loss is computed on, in figures.

    DataOptions(path, fmt, loss_on, packing, seq_len, ...)  ->  load_data(options, tokenizer)
        -> TrainingData.batches(micro, seed, rank, replicas, start)   endless, resumable
           TrainingData.eval                                         BlockDataset or None
           TrainingData.summary()                                    the "data" fields of a run

A file larger than ``stream_above`` bytes is streamed: read and tokenised as the run consumes it,
its blocks shuffled in a window, so memory stays flat; smaller ones are tokenised once (cached by
``datasets`` beside its copy of the file) and their blocks shuffled whole each epoch.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .batches import BlockDataset, block_batches, stream_batches
from .packing import Packer, PackStats, stack_blocks
from .records import (
    FORMATS,
    LOSS_ON,
    ROW_FORMATS,
    RecordEncoder,
    data_size,
    detect_format,
    first_record,
    open_records,
)

DEFAULT_STREAM_ABOVE = 256 * 2**20
ENCODE_BATCH = 256  # records per tokeniser call


@dataclass
class DataOptions:
    """How a run reads its data (train.py's --data ... flags). ``fmt`` / ``loss_on`` None: told
    from the first record / by the format (answers for chat and prompt-completion, all for
    text). ``stream_above`` None: never stream."""

    path: str | None = None
    fmt: str | None = None
    loss_on: str | None = None
    chat_template: str | None = None
    packing: str = "concat"
    seq_len: int = 128
    drop_long: bool = False
    workers: int = 1
    stream_above: int | None = DEFAULT_STREAM_ABOVE
    eval_path: str | None = None
    eval_fraction: float = 0.0
    seed: int = 1234
    pad_id: int = 0
    scale_rewards: str = "group"  # rollouts with rewards: normalised per group ("group") or not ("none")
    vocab_size: int | None = None  # the model's: a token id outside [0, vocab_size) is refused, naming its record

    def check(self) -> None:
        """One-line ValueErrors for values no data could make right."""
        if self.fmt is not None and self.fmt not in FORMATS:
            raise ValueError(f"--data-format {self.fmt!r}: use one of {', '.join(FORMATS)}")
        if self.loss_on is not None and self.loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on {self.loss_on!r}: use one of {', '.join(LOSS_ON)}")
        if self.workers < 1:
            raise ValueError(f"--data-workers must be >= 1, got {self.workers}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_path:
            raise ValueError("--eval-fraction holds out part of --data; --eval-data gives a file: choose one")
        if self.eval_fraction and self.path is None:
            raise ValueError("--eval-fraction holds out part of --data: give --data (or --eval-data FILE)")


@dataclass
class TrainingData:
    """The run's training blocks (whole, or a stream) and its evaluation blocks."""

    format: str
    loss_on: str
    options: DataOptions
    train: BlockDataset | None = None
    stream: Callable[..., Iterator[dict]] | None = None  # (epoch, record=True) -> blocks (streaming)
    eval: BlockDataset | None = None
    stream_stats: list[PackStats] = field(default_factory=list)  # one per epoch read so far
    load_s: float = 0.0  # reading, tokenising (or reading the cached tokens) and packing

    @property
    def streaming(self) -> bool:
        return self.stream is not None

    @property
    def stats(self) -> PackStats:
        return self.train.stats if self.train is not None else (self.stream_stats or [PackStats()])[-1]

    def batches(self, micro: int, seed: int, rank: int = 0, replicas: int = 1, start: int = 0):
        if self.streaming:
            return stream_batches(self.stream, micro, seed, rank, replicas, start)
        return block_batches(self.train, micro, seed, rank, replicas, start)

    def first_batch(self, micro: int) -> dict:
        """``micro`` blocks in file order (the engine's example batch, the probe loss)."""
        if self.train is not None:
            return self.train.rows(self._first(micro))
        import torch

        blocks = []
        for b in self.stream(0, record=False):
            blocks.append(b)
            if len(blocks) == micro:
                return {k: torch.stack([x[k] for x in blocks]) for k in blocks[0]}
        raise ValueError(f"the data stream holds fewer than {micro} blocks")

    def _first(self, micro):
        import torch

        if len(self.train) < micro:
            raise ValueError(f"{len(self.train)} blocks, fewer than one micro-batch of {micro}")
        return torch.arange(micro)

    def summary(self) -> dict:
        """The run summary's ``data`` fields: what was read and what the loss is computed on."""
        out = {
            "format": self.format,
            "loss_on": self.loss_on,
            "packing": self.options.packing,
            "streaming": self.streaming,
            **self.stats.as_dict(),
            "load_s": self.load_s,
        }
        if self.streaming:
            out["note"] = "streamed: counts of the part read so far"
        if self.eval is not None:
            out["eval"] = self.eval.stats.as_dict()
        return out

    def identity(self) -> dict:
        """What a resume must find the same: the records, their encoding and their packing."""
        o = self.options
        return {
            "format": self.format,
            "loss_on": self.loss_on,
            "packing": o.packing,
            "drop_long": o.drop_long,
            "streaming": self.streaming,
            "eval_fraction": o.eval_fraction,
            "chat_template": _short_hash(o.chat_template) if o.chat_template else None,
            "tokens": None if self.streaming else self.stats.tokens,
            "records": None if self.streaming else self.stats.records,
        }


def load_data(options: DataOptions, tokenizer) -> TrainingData:
    """Read, tell the format, encode and pack the run's data (see the module docstring)."""
    options.check()
    t0 = time.perf_counter()
    streaming = (
        options.path is not None and options.stream_above is not None and data_size(options.path) > options.stream_above
    )
    if streaming and options.eval_fraction:
        raise ValueError(
            f"--eval-fraction cannot hold records out of a streamed file ({options.path!r} is larger "
            f"than --stream-above): give --eval-data FILE, or raise --stream-above"
        )
    records = _corpus_records() if options.path is None else open_records(options.path, streaming=streaming)
    fmt = options.fmt or detect_format(
        first_record(records), f"{options.path}: record 1" if options.path else "the corpus"
    )
    loss_on = options.loss_on or ("all" if fmt == "text" else "answers")
    if fmt == "text" and loss_on == "answers":
        raise ValueError(
            "--loss-on answers needs answers: text records have none (use chat or prompt-completion "
            "data, or --loss-on all)"
        )
    _check_applies(options, fmt, streaming)
    if fmt in ROW_FORMATS:
        return _row_data(records, options, tokenizer, t0, fmt)
    encoder = RecordEncoder(tokenizer, fmt, loss_on, options.chat_template)
    data = TrainingData(fmt, loss_on, options)
    held = None
    if streaming:

        def epoch_blocks(epoch: int, record: bool = True) -> Iterator[dict]:
            packer = _packer(options, fmt)
            if record:  # the pass training reads (not a look at the first blocks)
                del data.stream_stats[epoch:]
                data.stream_stats.append(packer.stats)
            return packer.blocks(_encode_stream(records, encoder))

        data.stream = epoch_blocks
    else:
        with _one_at_a_time(options.path):  # the ranks of a node: the first tokenises, the others read its cache
            if options.eval_fraction:
                split = records.train_test_split(test_size=options.eval_fraction, seed=options.seed)
                records, held = split["train"], split["test"]
            data.train = _packed(records, encoder, options, fmt)
    if options.eval_path is not None:
        eval_records = open_records(options.eval_path)
        eval_fmt = options.fmt or detect_format(first_record(eval_records), options.eval_path)
        if eval_fmt != fmt:
            raise ValueError(
                f"--eval-data {options.eval_path!r} holds {eval_fmt} records, --data {fmt}: give both in one format"
            )
        held = eval_records
    if held is not None:
        with _one_at_a_time(options.eval_path or options.path):
            data.eval = _packed(held, encoder, options, fmt, what="eval")
    data.load_s = time.perf_counter() - t0
    return data


def _row_data(records, options: DataOptions, tokenizer, t0: float, fmt: str) -> TrainingData:
    """Preference pairs (``preference.py``) or rollouts (``rollouts.py``), each padded to its own
    rows; no evaluation split yet."""
    from .preference import PairEncoder, load_pairs, load_unpaired
    from .records import resolve_chat_template
    from .rollouts import RolloutEncoder, load_rollouts

    for flag, given in (("--eval-fraction", options.eval_fraction), ("--eval-data", options.eval_path)):
        if given:
            raise ValueError(
                f"{flag} with {fmt} data: evaluating an objective other than cross-entropy is not built yet"
            )
    first = first_record(records)
    chat = "prompt" in first and not isinstance(first["prompt"], str)
    if options.chat_template is not None and not chat:
        raise ValueError(
            f"--chat-template renders conversational records; these {fmt} records' prompts are not chat messages"
        )
    template = resolve_chat_template(tokenizer, options.chat_template) if chat else None
    data = TrainingData(fmt, "completions", options)
    o = options
    try:
        if fmt == "preference":
            encoder = PairEncoder(tokenizer, template)
            data.train = load_pairs(records, encoder, o.seq_len, o.pad_id, o.drop_long, vocab_size=o.vocab_size)
        elif fmt == "unpaired":
            encoder = PairEncoder(tokenizer, template)
            data.train = load_unpaired(records, encoder, o.seq_len, o.pad_id, o.drop_long, o.vocab_size)
        else:
            encoder = RolloutEncoder(tokenizer, template, o.scale_rewards)
            data.train = load_rollouts(records, encoder, o.seq_len, o.pad_id, o.drop_long, o.vocab_size)
    except ValueError as err:
        raise ValueError(f"{options.path}: {err}") from None
    data.load_s = time.perf_counter() - t0
    return data


def _check_applies(options: DataOptions, fmt: str, streaming: bool) -> None:
    """Refuse options these records would not use (none is dropped silently)."""
    if fmt in ROW_FORMATS and (streaming or options.packing != "none"):
        what = "streamed (larger than --stream-above)" if streaming else f"packed (--packing {options.packing})"
        fix = "raise --stream-above" if streaming else "give --packing none"
        raise ValueError(f"{fmt} records are padded rows, each record whole; they cannot be {what}: {fix}")
    if options.chat_template is not None and fmt not in ("chat", *ROW_FORMATS):  # (row formats: _row_data)
        raise ValueError(f"--chat-template renders chat records; these are {fmt} records")
    if fmt in ROW_FORMATS:
        for flag, given, why in (
            ("--loss-on", options.loss_on, "their loss is on the completions"),
            ("--data-workers", options.workers > 1, "they are encoded one by one, in the training process"),
        ):
            if given:
                raise ValueError(f"{flag} with {fmt} records: {why}; drop {flag}")
    if options.drop_long and fmt not in ROW_FORMATS and (fmt == "text" or options.packing == "concat"):
        raise ValueError(
            f"--drop-long leaves out chat / prompt-completion records longer than --seq-len under "
            f"--packing docs or none; {fmt} records under --packing {options.packing} flow across "
            f"blocks and are never cut"
        )
    if options.workers > 1 and streaming:
        raise ValueError(
            f"--data-workers {options.workers}: a streamed file ({options.path!r}, larger than "
            f"--stream-above) is tokenised as it is read, in the training process; drop the flag or "
            f"raise --stream-above to tokenise it whole first"
        )


def _one_at_a_time(path: str | None):
    """A lock per data file (in the temp dir), so processes of one machine tokenise it one after
    the other: the first writes ``datasets``' cache, the others read it."""
    import contextlib
    import tempfile

    from filelock import FileLock

    if path is None:
        return contextlib.nullcontext()
    key = hashlib.sha256(os.path.abspath(os.path.expanduser(path)).encode()).hexdigest()[:16]
    return FileLock(os.path.join(tempfile.gettempdir(), f"ds_dhelix-data-{key}.lock"))


def _packer(options: DataOptions, fmt: str) -> Packer:
    return Packer(
        options.seq_len,
        options.packing,
        whole_records=fmt != "text",
        drop_long=options.drop_long,
        pad_id=options.pad_id,
        vocab_size=options.vocab_size,
    )


def _packed(records, encoder: RecordEncoder, options: DataOptions, fmt: str, what: str = "train") -> BlockDataset:
    packer = _packer(options, fmt)
    source = (options.eval_path if what == "eval" and options.eval_path else options.path) or "the corpus"
    try:
        if isinstance(records, list):
            encoded = _encode_stream(records, encoder)
        else:
            mapped = records.map(
                encoder,
                batched=True,
                batch_size=ENCODE_BATCH,
                with_indices=True,
                remove_columns=records.column_names,
                num_proc=options.workers if options.workers > 1 else None,
                desc=f"tokenise ({what})",
            )
            encoded = _rows(mapped)
        fields = stack_blocks(packer.blocks(encoded))
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    return BlockDataset(fields, packer.stats)


def _rows(mapped) -> Iterator[dict]:
    for batch in mapped.with_format("numpy").iter(batch_size=1024):
        yield from ({"input_ids": i, "loss_mask": m} for i, m in zip(batch["input_ids"], batch["loss_mask"]))


def _encode_stream(records, encoder: RecordEncoder) -> Iterator[dict]:
    """Encode records as they come, ``ENCODE_BATCH`` at a time."""
    chunk: list[dict] = []
    done = 0
    for record in records:
        chunk.append(record)
        if len(chunk) == ENCODE_BATCH:
            yield from _encode_chunk(chunk, encoder, done)
            done += len(chunk)
            chunk = []
    if chunk:
        yield from _encode_chunk(chunk, encoder, done)


def _encode_chunk(chunk: list[dict], encoder: RecordEncoder, first: int) -> Iterator[dict]:
    keys = chunk[0].keys()
    out = encoder({k: [r.get(k) for r in chunk] for k in keys}, range(first, first + len(chunk)))
    yield from ({"input_ids": i, "loss_mask": m} for i, m in zip(out["input_ids"], out["loss_mask"]))


def _corpus_records() -> list[dict]:
    from .corpus import build_embedded_corpus
    from .text import split_documents

    return [{"text": d} for d in split_documents(build_embedded_corpus())]


def _short_hash(text: str) -> str:
    path = os.path.expanduser(text)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def parse_size(text: str) -> int | None:
    """``--stream-above`` sizes: 256MB, 2GB, 1000000 (bytes); ``never`` -> None."""
    if text.strip().lower() == "never":
        return None
    units = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--stream-above {text!r}: give a size such as 256MB or 2GB, or never")
