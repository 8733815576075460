"""Text to token ids: a user's .txt / .jsonl file, its documents, their ids.

load_text(path)  ->  split_documents(text)  ->  encode_documents(tokenizer, docs)   (EOS after each)
                                                encode_text(tokenizer, text)        (no specials)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch


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
