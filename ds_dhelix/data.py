"""Training text and tokens without downloads: embedded corpus, tokenizer, fixed-length batches.

    build_embedded_corpus()  pydoc topics + stdlib docstrings (~1 MB of English, deterministic)
        -> get_tokenizer()   byte-level BPE, trained once and cached on disk by (vocab, corpus hash)
        -> encode_text()     one LongTensor of token ids
        -> batch_iterator()  {"input_ids", "labels"} [micro, seq_len], shuffled by seed, sharded over DP

`load_text` reads a user's own .txt / .jsonl instead of the embedded corpus.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
from typing import Iterator, Sequence

import torch

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""Trained first, so their ids are 0, 1, 2 (the ids the hf_models presets use)."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_CACHE_DIR = "~/.cache/ds_dhelix"
_TOKENIZER_FORMAT = 1  # bump when the training recipe changes, to invalidate cached tokenizers

# Fixed list, fixed order. Pure-Python modules are read as source, never imported.
CORPUS_MODULES = (
    "_collections_abc", "abc", "argparse", "ast", "base64", "bisect", "builtins", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures._base", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "email.message", "enum", "fractions", "functools", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html.parser", "http.client", "inspect", "io", "ipaddress", "itertools",
    "json", "locale", "logging", "mailbox", "math", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "socket",
    "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "tokenize", "traceback", "types", "typing", "unittest.case", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile",
)


# --------------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------------


@functools.cache
def build_embedded_corpus() -> str:
    """Python's help topics plus the docstrings of `CORPUS_MODULES`, in a fixed order. No download."""
    from pydoc_data.topics import topics

    parts = [f"# {name}\n\n{topics[name].strip()}" for name in sorted(topics)]
    seen: set[str] = set()
    for module_name in CORPUS_MODULES:
        parts.extend(_module_docs(module_name, seen))
    return "\n\n".join(parts) + "\n"


def _module_docs(module_name: str, seen: set[str]) -> list[str]:
    """Module, class, method and function docstrings of one stdlib module, each part "## title" + doc.

    Pure-Python modules are read from their source (ast), so what other libraries patch into a module
    at runtime (pytest replaces threading.excepthook, transformers adds Logger.warning_once) cannot
    change the corpus. C modules (builtins, math, ...) are introspected. Missing modules are skipped.
    """
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return []
    if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
        with open(spec.origin, encoding="utf-8") as f:
            docs = _source_docs(module_name, ast.parse(f.read()))
    else:
        docs = _runtime_docs(module_name)
    out = []
    for title, doc in docs:
        doc = inspect.cleandoc(doc) if doc else ""
        if len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            out.append(f"## {title}\n\n{doc}")
    return out


def _source_docs(module_name: str, tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    yield module_name, ast.get_docstring(tree, clean=False)
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, defs) and not node.name.startswith("_"):
            yield f"{module_name}.{node.name}", ast.get_docstring(node, clean=False)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, defs) and not member.name.startswith("_"):
                        yield f"{module_name}.{node.name}.{member.name}", ast.get_docstring(member, clean=False)


def _runtime_docs(module_name: str) -> Iterator[tuple[str, str | None]]:
    module = importlib.import_module(module_name)
    yield module_name, module.__doc__
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue  # private, or not defined here (re-exported or patched in)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            yield f"{module_name}.{name}", obj.__doc__
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isroutine(member):
                    yield f"{module_name}.{name}.{attr}", member.__doc__


def corpus_hash(text: str) -> str:
    """Short content hash (sha256 prefix) used in cache keys."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------


def train_tokenizer(text: str, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE on ``text``; returns a transformers `PreTrainedTokenizerFast`.

    Byte-level means every string round-trips: ``decode(encode(x)) == x``. Ids 0/1/2 are pad/bos/eos.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    smallest = 256 + len(SPECIAL_TOKENS)  # every byte + the specials
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(f"vocab_size must be an int >= {smallest} (256 bytes + specials), got {vocab_size!r}")
    if not text:
        raise ValueError("cannot train a tokenizer on empty text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = text.split("\n\n")  # paragraphs: lets the trainer count words in parallel
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def get_tokenizer(cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The embedded-corpus tokenizer, trained once and cached under ``cache_dir``.

    Cache key = (vocab size, corpus hash). Safe when several ranks call at once: each trains into a
    private temp dir and atomically renames it into place; a rank that loses the race uses the winner's.
    """
    from transformers import PreTrainedTokenizerFast

    text = build_embedded_corpus()
    root = os.path.expanduser(os.fspath(cache_dir))
    final = os.path.join(root, f"tokenizer-f{_TOKENIZER_FORMAT}-v{vocab_size}-{corpus_hash(text)}")
    if not os.path.isfile(os.path.join(final, "tokenizer.json")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=root)
        try:
            train_tokenizer(text, vocab_size).save_pretrained(tmp)
            os.rename(tmp, final)  # atomic; fails if another rank already put its copy there
        except OSError:
            if not os.path.isfile(os.path.join(final, "tokenizer.json")):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(final, local_files_only=True)


def encode_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as a 1-D LongTensor (no specials added)."""
    ids = tokenizer(text.split("\n\n"), add_special_tokens=False)["input_ids"]
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    flat: list[int] = []
    for i, part in enumerate(ids):
        if i:
            flat.extend(sep)
        flat.extend(part)
    return torch.tensor(flat, dtype=torch.long)


def split_documents(text: str) -> list[str]:
    """The documents of a text: its blank-line separated chunks (a .jsonl file's lines are joined
    that way by ``load_text``)."""
    return [d for d in text.split("\n\n") if d.strip()]


def encode_documents(tokenizer, docs: Sequence[str]) -> torch.Tensor:
    """Token ids of ``docs`` as one 1-D LongTensor, each document followed by the tokenizer's EOS
    token, so a packed block shows where one document ends and the next begins."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer defines no EOS token; documents could not be told apart in packed blocks")
    flat: list[int] = []
    for part in tokenizer(list(docs), add_special_tokens=False)["input_ids"]:
        flat.extend(part)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.long)


# --------------------------------------------------------------------------------------------------
# user text
# --------------------------------------------------------------------------------------------------

SUPPORTED_TEXT_SUFFIXES = (".txt", ".jsonl")


def load_text(path: str | os.PathLike) -> str:
    """Read a local .txt file, or a .jsonl file whose lines are objects with a "text" string field.

    Documents of a .jsonl file are joined with blank lines. Bad files raise a one-line ValueError.
    """
    path = os.path.expanduser(os.fspath(path))
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_TEXT_SUFFIXES:
        raise ValueError(f"unsupported text file {path!r}: use one of {', '.join(SUPPORTED_TEXT_SUFFIXES)}")
    if not os.path.isfile(path):
        raise ValueError(f"text file {path!r} " + ("is a directory" if os.path.isdir(path) else "not found"))
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read text file {path!r} as UTF-8: {e}") from None
    text = _parse_jsonl(path, raw) if suffix == ".jsonl" else raw
    if not text.strip():
        raise ValueError(f"text file {path!r} holds no text")
    return text


def _parse_jsonl(path: str, raw: str) -> str:
    docs = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'{path}:{lineno}: each line must be a JSON object with a "text" string field')
        docs.append(obj["text"])
    return "\n\n".join(docs)


# --------------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------------


PACKINGS = ("concat", "docs", "none")
"""How documents become blocks of ``seq_len`` tokens (``train.py --packing``):

- ``concat``: documents back to back, EOS between them; positions run on and attention crosses
  documents (classic GPT packing);
- ``docs``: the same blocks, plus ``position_ids`` that restart at each document and targets across
  a document boundary ignored (-100); the op graph masks attention across documents (a
  block-diagonal causal mask built from ``position_ids``);
- ``none``: each document padded to its own block(s) (a longer one is cut into several), with an
  ``attention_mask`` and -100 targets on the padding."""


class TokenDataset(torch.utils.data.Dataset):
    """Blocks of ``seq_len`` tokens; item = {"input_ids", "labels"} (labels = inputs, the HF
    causal-LM model shifts them), plus "position_ids" (``packing="docs"``) or "attention_mask"
    (``packing="none"``). ``eos_id``: the document separator in ``token_ids`` (needed by "docs"
    and "none"); ``pad_id``: the padding of "none". The tail shorter than a block is left out
    (``concat`` / ``docs``)."""

    def __init__(self, token_ids: Sequence[int] | torch.Tensor, seq_len: int, packing: str = "concat",
                 eos_id: int | None = None, pad_id: int = 0):
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        _check_positive("seq_len", seq_len)
        if packing not in PACKINGS:
            raise ValueError(f"packing {packing!r}: use one of {', '.join(PACKINGS)}")
        if packing != "concat" and eos_id is None:
            raise ValueError(f"packing {packing!r} needs the EOS id that separates documents")
        self.seq_len, self.packing = seq_len, packing
        if packing == "none":
            self.fields = _padded_documents(ids, seq_len, eos_id, pad_id)
        else:
            if ids.numel() < seq_len:
                raise ValueError(f"{ids.numel()} tokens are fewer than one block of seq_len {seq_len}")
            blocks = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
            self.fields = {"input_ids": blocks, "labels": blocks}
            if packing == "docs":
                self.fields = {"input_ids": blocks, **document_positions(blocks, eos_id)}
        self.blocks = self.fields["input_ids"]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows(torch.tensor([i]), squeeze=True)

    def rows(self, index: torch.Tensor, squeeze: bool = False) -> dict[str, torch.Tensor]:
        out = {k: v[index].clone() for k, v in self.fields.items()}
        return {k: v[0] for k, v in out.items()} if squeeze else out


def document_positions(blocks: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """``position_ids`` restarting after every EOS (and at each block's start), and ``labels`` with
    -100 at each document's first token inside a block (the previous document's EOS does not
    predict it)."""
    b, s = blocks.shape
    start = torch.zeros_like(blocks, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = blocks[:, :-1] == eos_id
    index = torch.arange(s).expand(b, s)
    last_start = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    labels = blocks.clone()
    labels[:, 1:][start[:, 1:]] = -100
    return {"labels": labels, "position_ids": index - last_start}


def attention_mask(seq_len: int, position_ids: torch.Tensor | None = None, additive_dtype=None, device=None):
    """The causal mask [b or 1, 1, s, s], block-diagonal over packed documents when
    ``position_ids`` are given (a document starts where its position is 0): boolean (True: may
    attend; sdpa), or additive in ``additive_dtype`` (eager attention adds it to the scores)."""
    device = position_ids.device if position_ids is not None else device
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril().unsqueeze(0)
    if position_ids is not None:
        segment = (position_ids == 0).cumsum(dim=1)
        allowed = (segment[:, :, None] == segment[:, None, :]) & allowed
    allowed = allowed[:, None]
    if additive_dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=additive_dtype, device=device).masked_fill(
        ~allowed, torch.finfo(additive_dtype).min)


def hf_model_inputs(batch: dict, eager_dtype: torch.dtype | None = None) -> dict:
    """The keyword arguments a plain HF causal LM takes for ``batch``: packed documents
    (``position_ids``) also get the block-diagonal causal mask the op graph builds from them
    (:func:`attention_mask`; additive in ``eager_dtype`` for eager attention)."""
    pos = batch.get("position_ids")
    if pos is None:
        return batch
    return {**batch, "attention_mask": attention_mask(pos.shape[1], pos, eager_dtype)}


def _padded_documents(ids: torch.Tensor, seq_len: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    ends = (ids == eos_id).nonzero().flatten().tolist()
    rows, lo = [], 0
    for end in ends + ([ids.numel() - 1] if not ends or ends[-1] != ids.numel() - 1 else []):
        doc = ids[lo:end + 1]
        lo = end + 1
        rows += [doc[i:i + seq_len] for i in range(0, doc.numel(), seq_len)]
    if not rows:
        raise ValueError("no documents to pad")
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, :row.numel()] = row
        mask[r, :row.numel()] = 1
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def batch_iterator(
    token_ids: Sequence[int] | torch.Tensor,
    micro_batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    num_replicas: int = 1,
    start: int = 0,
    packing: str = "concat",
    eos_id: int | None = None,
    pad_id: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches {"input_ids", "labels"} (+ "position_ids" / "attention_mask" by
    ``packing``, see ``PACKINGS``): LongTensor [micro_batch_size, seq_len].

    Each epoch shuffles the blocks with ``seed + epoch``; replica ``rank`` takes every
    ``num_replicas``-th block, so replicas see disjoint blocks and the same number of batches.
    ``start``: skip the first ``start`` micro-batches of this replica (a resumed run continues where
    the checkpoint's run stopped: epoch ``start // batches_per_epoch``, batch ``start % ...``).
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    _check_positive("micro_batch_size", micro_batch_size)
    _check_positive("num_replicas", num_replicas)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
    dataset = TokenDataset(token_ids, seq_len, packing, eos_id, pad_id)
    per_replica = len(dataset) // num_replicas
    num_batches = per_replica // micro_batch_size
    if num_batches == 0:
        raise ValueError(
            f"{len(dataset)} blocks of seq_len {seq_len} cannot fill one micro-batch of {micro_batch_size} "
            f"on each of {num_replicas} replicas (need {micro_batch_size * num_replicas} blocks); "
            f"use more text, a shorter seq_len or a smaller micro-batch"
        )
    return _batches(dataset, micro_batch_size, seed, rank, num_replicas, num_batches, start)


def _batches(dataset, micro_batch_size, seed, rank, num_replicas, num_batches, start=0):
    epoch, first = divmod(start, num_batches)
    while True:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[: num_batches * micro_batch_size * num_replicas][rank::num_replicas]
        for b in range(first, num_batches):
            yield dataset.rows(mine[b * micro_batch_size : (b + 1) * micro_batch_size])
        epoch, first = epoch + 1, 0


def check_batch_shape(batch: dict[str, torch.Tensor], expected: tuple[int, int]) -> None:
    """Raise ValueError unless input_ids and labels are LongTensors of shape ``expected`` = (micro, seq).

    Every micro-batch of a run must have one shape: the schedules pair micro-batches and the peers'
    collectives assume the same sizes, so a changed length would hang or mis-train.
    """
    micro, seq = expected
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"batch has no '{key}' (keys: {sorted(batch)})")
        t = batch[key]
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"batch['{key}'] must be a 2-D tensor [micro_batch, seq_len], got {_describe(t)}")
        if t.shape[1] != seq:
            raise ValueError(
                f"sequence length changed: expected {seq}, got {t.shape[1]} (batch['{key}'] shape {tuple(t.shape)}); "
                f"every micro-batch must have the same length: pad or pack the data to {seq} tokens"
            )
        if t.shape[0] != micro:
            raise ValueError(
                f"micro-batch size changed: expected {micro}, got {t.shape[0]} "
                f"(batch['{key}'] shape {tuple(t.shape)}); "
                f"drop the last partial batch or set train_micro_batch_size_per_gpu to {t.shape[0]}"
            )
        if t.dtype != torch.long:
            raise ValueError(f"batch['{key}'] must hold token ids (torch.long), got {t.dtype}")


def _describe(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
