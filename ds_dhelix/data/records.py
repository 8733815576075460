"""A user's data file as records, and each record as token ids plus the mask of the tokens the loss
is computed on. Files are read through Hugging Face ``datasets`` (which caches what it parsed and
what ``encode_records`` tokenised, so a second run of the same file starts at once).

    open_records(path, streaming)                          .txt .jsonl .json .parquet, save_to_disk dir
      -> detect_format(first record)                       text | chat | prompt-completion
      -> RecordEncoder(tokenizer, format, loss_on, template)   {"input_ids", "loss_mask"} per record

Formats:

- ``text``: a ``text`` string (a .txt file: its blank-line separated paragraphs); EOS appended;
- ``chat``: a ``messages`` list of ``{"role", "content"}``, rendered with the tokenizer's chat
  template (or one given); the loss on the assistant turns (``loss_on="answers"``);
- ``prompt-completion``: ``prompt`` and ``completion`` strings, each tokenised alone and joined,
  EOS appended; the loss on the completion and its EOS;
- ``preference``: ``prompt``, ``chosen`` and ``rejected`` (TRL's preference data), pairs of rows
  for a preference objective (``preference.py``; not through ``RecordEncoder``);
- ``unpaired``: ``prompt``, ``completion`` and ``label`` (TRL's unpaired preference data), rows for
  KTO (``preference.py``);
- ``rollouts``: a prompt's sampled ``completions`` with their rewards, rows for GRPO's update
  (``rollouts.py``).
"""

from __future__ import annotations

import os
import re

FORMATS = ("text", "chat", "prompt-completion", "preference", "unpaired", "rollouts")
ROW_FORMATS = ("preference", "unpaired", "rollouts")
"""Formats whose records become padded rows of their own (an objective's data, never packed)."""
LOSS_ON = ("all", "answers")
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""``--chat-template chatml``: ChatML turns, the assistant's marked for the loss mask (for a
tokenizer without a template of its own, such as the presets'). Renders byte for byte what the
standard ChatML template does (``<|im_start|>role\ncontent<|im_end|>\n`` per turn): the newline
after a turn is an expression, since transformers compiles templates with ``trim_blocks``, which
drops a newline written right after a block tag. The assistant's newline is inside its loss span,
as a template without markers (answers told turn by turn) also counts it."""


def data_kind(path: str) -> str:
    """How ``path`` is read: ``txt`` | ``json`` | ``parquet`` | ``saved`` (a ``save_to_disk``
    directory). A bad path raises a one-line ValueError naming it and what is accepted."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "saved"
        raise ValueError(
            f"data directory {path!r} is not a dataset written by datasets.save_to_disk "
            f"(no dataset_info.json / dataset_dict.json); give a file ({', '.join(DATA_SUFFIXES)})"
        )
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(
            f"unsupported data file {path!r}: use one of {', '.join(DATA_SUFFIXES)} "
            f"or a datasets.save_to_disk directory"
        )
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} not found")
    return {".txt": "txt", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}[suffix]


def data_size(path: str) -> int:
    """Bytes of the file (or of the files of a saved directory)."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def open_records(path: str, streaming: bool = False):
    """The records of ``path`` as a ``datasets.Dataset`` (``streaming``: an ``IterableDataset``
    read as it is consumed, so memory stays flat however large the file)."""
    import datasets

    from .text import load_text, split_documents

    kind, path = data_kind(path), os.path.expanduser(os.fspath(path))
    if int(os.environ.get("RANK", 0)) != 0:
        datasets.disable_progress_bars()
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"saved dataset {path!r} has splits {sorted(ds)} and no 'train'; save one split")
                ds = ds["train"]
            return ds.to_iterable_dataset() if streaming else ds
        if kind == "txt":
            if streaming:
                return datasets.load_dataset(
                    "text", data_files=path, split="train", streaming=True, sample_by="paragraph"
                )
            return datasets.Dataset.from_dict({"text": split_documents(load_text(path))})
        if kind == "parquet" and streaming:
            return ParquetRecords(path)
        return datasets.load_dataset(kind, data_files=path, split="train", streaming=streaming)
    except ValueError:
        raise
    except Exception as err:  # datasets wraps parse errors in its own classes
        if kind == "json" and path.lower().endswith(".jsonl"):
            _check_json_lines(path)  # names the line
        cause = err.__cause__ or err
        raise ValueError(
            f"cannot read {path!r} as {kind}: {type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}"
        ) from None


class ParquetRecords:
    """A parquet file's records as a stream: ``pyarrow.parquet.ParquetFile.iter_batches``, a batch
    of rows at a time (each pass reads the file again from its start). ``datasets``' own parquet
    streaming held ever more memory as it read (2 GB of RSS after 2,000 records of a 2 GB file);
    this holds one batch of rows and the row group it comes from. Decoding runs on this thread
    (``use_threads=False``): no reader threads are alive at exit."""

    def __init__(self, path: str, batch_rows: int = 256):
        import pyarrow.parquet as pq

        self.path, self.batch_rows = path, batch_rows
        pq.ParquetFile(path).close()  # a file that is not parquet fails here, before any model

    def __iter__(self):
        import pyarrow.parquet as pq

        with pq.ParquetFile(self.path, pre_buffer=False) as f:
            for batch in f.iter_batches(batch_size=self.batch_rows, use_threads=False):
                yield from batch.to_pylist()


def _check_json_lines(path: str) -> None:
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def first_record(records) -> dict:
    for record in records:
        return record
    raise ValueError("the data holds no records")


def detect_format(record: dict, where: str = "the data") -> str:
    """The format of a record by its fields: ``chosen`` + ``rejected`` -> preference (pairs,
    ``preference.py``), ``completions`` / ``completion_ids`` -> rollouts (GRPO, ``rollouts.py``),
    ``completion`` + ``label`` -> unpaired (KTO, ``preference.py``),
    ``messages`` -> chat, ``prompt`` + ``completion`` -> prompt-completion,
    ``text`` -> text."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be an object, got {type(record).__name__}")
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "completions" in record or "completion_ids" in record:
        return "rollouts"
    if "completion" in record and "label" in record:
        return "unpaired"
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if "text" in record:
        return "text"
    raise ValueError(
        f"{where}: cannot tell the format from the fields {sorted(record)}: give 'text', 'messages' "
        f"(chat), 'prompt' and 'completion', 'prompt', 'chosen' and 'rejected' (preference pairs), 'prompt', "
        f"'completion' and 'label' (unpaired), or 'prompt' and 'completions' (rollouts) (or force one with "
        f"--data-format)"
    )


def resolve_chat_template(tokenizer, template: str | None) -> str:
    """The chat template to render ``messages`` with: ``template`` (``chatml``, a file, or the
    template text), else the tokenizer's own; none at all raises naming the flag."""
    if template == "chatml":
        return CHATML_TEMPLATE
    if template is not None:
        path = os.path.expanduser(template)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        if "{%" in template or "{{" in template:
            return template
        raise ValueError(f"--chat-template {template!r}: not a file, not 'chatml' and not a Jinja template")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one
        own = own.get("default")
    if not own:
        raise ValueError(
            "chat data needs a chat template and this tokenizer has none: give --chat-template FILE "
            "(a Jinja template) or --chat-template chatml"
        )
    return own


class RecordEncoder:
    """Records of one format -> ``{"input_ids": [[...]], "loss_mask": [[...]]}`` (a batched
    ``datasets.map`` function; ``loss_mask[t]`` 1: token t is a target of the loss).

    Chat templates with ``{% generation %}`` markers give the assistant mask through transformers'
    ``apply_chat_template(return_assistant_tokens_mask=True)``; a template without them is rendered
    turn by turn, the tokens each assistant turn adds being its answer (a template that renders
    earlier turns differently once later ones follow is refused: no exact mask exists then)."""

    def __init__(self, tokenizer, fmt: str, loss_on: str = "answers", chat_template: str | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"data format {fmt!r}: use one of {', '.join(FORMATS)}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss on {loss_on!r}: use one of {', '.join(LOSS_ON)}")
        self.tokenizer, self.fmt, self.loss_on = tokenizer, fmt, loss_on
        self.eos = tokenizer.eos_token_id
        if fmt != "chat" and self.eos is None:
            raise ValueError("the tokenizer defines no EOS token: the end of a record could not be marked")
        self.template = resolve_chat_template(tokenizer, chat_template) if fmt == "chat" else None
        self.marked = bool(self.template and _GENERATION.search(self.template))

    def __call__(self, batch: dict, indices=None) -> dict:
        n = len(next(iter(batch.values())))
        records = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        for i, r in enumerate(records):
            try:
                records[i] = self.check(r)
            except ValueError as err:
                where = f"record {indices[i] + 1}" if indices is not None else "a record"
                raise ValueError(f"{where} ({self.fmt}): {err}") from None
        encode = {"text": self._texts, "prompt-completion": self._completions, "chat": self._chats}[self.fmt]
        ids, masks = encode(records)
        if self.loss_on == "all":
            masks = [[1] * len(m) for m in masks]
        return {"input_ids": ids, "loss_mask": masks}

    def check(self, record: dict) -> dict:
        """The record's fields this format reads (chat: the messages' role and content only), or a
        ValueError naming the one it lacks or has wrong."""
        if self.fmt == "text":
            return {"text": _field(record, "text", str)}
        if self.fmt == "prompt-completion":
            return {"prompt": _field(record, "prompt", str), "completion": _field(record, "completion", str)}
        return {"messages": chat_messages(record)}

    def _texts(self, records):
        texts = [r["text"] for r in records]
        ids = [t + [self.eos] for t in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return ids, [[1] * len(t) for t in ids]

    def _completions(self, records):
        prompts = self.tokenizer([r["prompt"] for r in records], add_special_tokens=False)["input_ids"]
        answers = self.tokenizer([r["completion"] for r in records], add_special_tokens=False)["input_ids"]
        ids = [p + a + [self.eos] for p, a in zip(prompts, answers)]
        return ids, [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(prompts, answers)]

    def _chats(self, records):
        ids, masks = [], []
        for r in records:
            messages = r["messages"]
            i, m = self._marked_chat(messages) if self.marked else self._turn_by_turn(messages)
            ids.append(i)
            masks.append(m)
        return ids, masks

    def _render(self, messages, **kw):
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=True, return_dict=True, **kw
        )

    def _marked_chat(self, messages):
        out = self._render(messages, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]

    def _turn_by_turn(self, messages):
        full = list(self._render(messages)["input_ids"])
        mask = [0] * len(full)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = list(self._render(messages[:k], add_generation_prompt=True)["input_ids"]) if k else []
            upto = list(self._render(messages[: k + 1])["input_ids"])
            if full[: len(before)] != before or full[: len(upto)] != upto or len(upto) < len(before):
                raise ValueError(
                    "the chat template renders earlier turns differently once later turns follow, so "
                    "the assistant tokens cannot be told exactly; give --chat-template with "
                    "{% generation %} markers around the assistant content"
                )
            mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
        return full, mask


def _field(record: dict, name: str, kind: type):
    value = record.get(name)
    if not isinstance(value, kind):
        raise ValueError(
            f"record field {name!r} must be a {kind.__name__}, got {type(value).__name__} "
            f"(record fields: {sorted(record)})"
        )
    return value


def chat_messages(record: dict) -> list[dict]:
    """A record's ``messages`` checked (roles, string contents), each kept to its role and content."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.80}")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(
                f"message {k} must be {{'role': one of {', '.join(CHAT_ROLES)}, 'content': a string}}, got {m!r:.80}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out
