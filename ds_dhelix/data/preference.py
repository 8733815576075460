"""Preference pairs as TRL reads them, to micro-batches of a paired objective (``dhelix.objective``).

A record holds ``prompt``, ``chosen`` and ``rejected``: strings (the completions follow the
prompt's tokens, EOS appended), or conversational (``prompt`` a list of messages, ``chosen`` /
``rejected`` lists of assistant messages, rendered with the chat template: the completion is what
the full conversation adds to the prompt rendered with its generation prompt). Optional
``ref_chosen_logps`` / ``ref_rejected_logps`` (floats, as TRL precomputes them) carry the
reference model's log-probability sums of the two completions.

Each pair becomes two rows of ``seq_len`` tokens, right-padded, labels -100 on the prompt and the
padding (a row longer than ``seq_len`` is cut, or with ``drop_long`` its pair left out; a pair
whose completion was cut away entirely is left out). A micro-batch of ``micro`` pairs is
``2 x micro`` rows: the chosen rows, then the rejected rows in the same order (``PairDataset``),
with ``ref_logps`` [2 x micro] when the records carry references.
"""

from __future__ import annotations

import torch

from .batches import BlockDataset
from .packing import PackStats, check_ids

PAIR_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")
REFERENCE_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")


class PairDataset(BlockDataset):
    """Pairs (fields [N, 2, ...]) as a ``BlockDataset``: ``len`` counts pairs, ``rows(index)`` gives
    the micro-batch of those pairs (their first rows, then their second rows)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows(torch.tensor([i]))

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[index].transpose(0, 1).reshape(-1, *v.shape[2:]).clone() for k, v in self.fields.items()}


class PairEncoder:
    """Records -> each pair's two token lists and loss masks (and references); ``template``: the
    chat template of conversational records (``records.resolve_chat_template``), else None."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer, self.template, self.eos = tokenizer, template, tokenizer.eos_token_id
        if self.eos is None:
            raise ValueError("the tokenizer defines no EOS token: the end of a completion could not be marked")

    def __call__(self, record: dict, where: str):
        missing = [f for f in PAIR_FIELDS if f not in record]
        if missing:
            raise ValueError(
                f"{where}: a preference record needs {', '.join(PAIR_FIELDS)}; it lacks {', '.join(missing)} "
                f"(a record with the prompt inside chosen / rejected: give the prompt as its own field)"
            )
        refs = [record.get(f) for f in REFERENCE_FIELDS]
        if any(r is not None and not isinstance(r, int | float) for r in refs):
            raise ValueError(f"{where}: {' / '.join(REFERENCE_FIELDS)} must be numbers, got {refs!r:.80}")
        prompt = record["prompt"]
        if isinstance(prompt, str):
            rows = [self._text(prompt, record[k], k, where) for k in ("chosen", "rejected")]
        else:
            rows = [self._chat(prompt, record[k], k, where) for k in ("chosen", "rejected")]
        return rows, refs

    def _text(self, prompt: str, completion, key: str, where: str):
        if not isinstance(completion, str):
            raise ValueError(f"{where}: {key!r} must be a string like the prompt, got {type(completion).__name__}")
        p, c = (self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prompt, completion))
        return p + c + [self.eos], [0] * len(p) + [1] * (len(c) + 1)

    def _chat(self, prompt, completion, key: str, where: str):
        from .records import chat_messages

        if self.template is None:
            raise ValueError(f"{where}: conversational records need a chat template (--chat-template)")
        try:
            prompt, completion = chat_messages({"messages": prompt}), chat_messages({"messages": completion})
        except ValueError as err:
            raise ValueError(f"{where} ({key}): {err}") from None
        render = self.tokenizer.apply_chat_template
        before = list(render(prompt, chat_template=self.template, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
        full = list(render(prompt + completion, chat_template=self.template, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
        if full[: len(before)] != before:
            raise ValueError(
                f"{where}: the chat template renders the prompt differently once the {key} answer follows, so "
                f"the completion's tokens cannot be told; give --chat-template (e.g. chatml)"
            )
        return full, [0] * len(before) + [1] * (len(full) - len(before))


def load_pairs(
    records,
    encoder: PairEncoder,
    seq_len: int,
    pad_id: int,
    drop_long: bool = False,
    kept: list | None = None,
    vocab_size: int | None = None,
) -> PairDataset:
    """Every record of ``records`` as a pair of rows (module docstring); ``kept`` gets the indices
    of the records that became pairs; a token id outside ``vocab_size`` is refused naming the record."""
    stats = PackStats(seq_len=seq_len)
    ids, labels, refs = [], [], []
    with_refs = None
    for k, record in enumerate(records):
        where = f"record {k + 1}"
        rows, ref = encoder(record, where)
        for r, _ in rows:
            check_ids(r, vocab_size, where)
        given = all(r is not None for r in ref)
        if with_refs is None:
            with_refs = given
        if given != with_refs:
            raise ValueError(
                f"{where}: {' / '.join(REFERENCE_FIELDS)} given for some records only; give them for all or none"
            )
        stats.records += 1
        stats.tokens += sum(len(r) for r, _ in rows)
        if any(len(r) > seq_len for r, _ in rows):
            if drop_long:
                stats.dropped += 1
                continue
            stats.truncated += 1
        pair = [_padded(r[:seq_len], m[:seq_len], seq_len, pad_id) for r, m in rows]
        if any(bool((lab == -100).all()) for _, lab in pair):
            stats.no_loss += 1
            continue
        stats.padding_tokens += sum(seq_len - min(len(r), seq_len) for r, _ in rows)
        ids.append(torch.stack([i for i, _ in pair]))
        if kept is not None:
            kept.append(k)
        labels.append(torch.stack([lab for _, lab in pair]))
        if with_refs:
            refs.append(torch.tensor(ref, dtype=torch.float32))
    if not ids:
        raise ValueError(f"no preference pair fits --seq-len {seq_len} with a completion token left")
    fields = {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}
    if with_refs:
        fields["ref_logps"] = torch.stack(refs)
    stats.blocks = 2 * len(ids)
    stats.loss_tokens = int((fields["labels"] != -100).sum())
    return PairDataset(fields, stats)


def load_unpaired(
    records, encoder: PairEncoder, seq_len: int, pad_id: int, drop_long: bool = False, vocab_size: int | None = None
) -> PairDataset:
    """KTO's unpaired records (``prompt``, ``completion``, ``label``: desirable or not; optional
    ``ref_logps`` / ``ref_KL_logps`` as TRL precomputes them) as pairs of rows: the completion, then
    its KL row, the prompt with the next record's completion (file order, the last with the first's),
    so the KL row and its reference do not depend on how the records are batched. ``kto_label``
    [N, 2] marks the desirable ones."""
    records = list(records)
    if len(records) < 2:
        raise ValueError("KTO's KL rows pair each prompt with another record's completion: give at least 2 records")
    pairs, labels = [], []
    for k, r in enumerate(records):
        where = f"record {k + 1}"
        missing = [f for f in UNPAIRED_FIELDS if f not in r]
        if missing:
            raise ValueError(
                f"{where}: an unpaired record needs {', '.join(UNPAIRED_FIELDS)}; it lacks {', '.join(missing)}"
            )
        if not isinstance(r["label"], bool):
            raise ValueError(f"{where}: 'label' must be true (desirable) or false, got {r['label']!r:.40}")
        pair = {
            "prompt": r["prompt"],
            "chosen": r["completion"],
            "rejected": records[(k + 1) % len(records)]["completion"],
        }
        refs = (r.get("ref_logps"), r.get("ref_KL_logps"))
        if (refs[0] is None) != (refs[1] is None):
            raise ValueError(
                f"{where}: give both ref_logps and ref_KL_logps (the completion's and its KL row's), or neither"
            )
        if refs[0] is not None:
            pair.update(ref_chosen_logps=refs[0], ref_rejected_logps=refs[1])
        pairs.append(pair)
        labels.append(r["label"])
    kept: list[int] = []
    data = load_pairs(pairs, encoder, seq_len, pad_id, drop_long, kept, vocab_size)
    data.fields["kto_label"] = torch.tensor([[labels[k]] * 2 for k in kept], dtype=torch.float32)
    return data


def _padded(ids: list[int], mask: list[int], seq_len: int, pad_id: int):
    row = torch.full((seq_len,), pad_id, dtype=torch.long)
    row[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    lab = torch.full((seq_len,), -100, dtype=torch.long)
    keep = torch.tensor(mask, dtype=torch.bool)
    lab[: len(ids)] = row[: len(ids)].masked_fill(~keep, -100)
    return row, lab
