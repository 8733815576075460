"""Sampled completions with their rewards, to micro-batches of GRPO's update (``dhelix.objective``
"grpo"). Generating them stays outside: a record is one prompt's group, as a generation server
(vLLM, TRL's) returns it.

    {"prompt": "...", "completions": ["...", "..."], "rewards": [1.0, 0.0]}
    {"prompt_ids": [...], "completion_ids": [[...], [...]], "advantages": [0.7, -0.7],
     "old_logps": [[...], [...]], "ref_logps": [[...], [...]]}

- ``prompt`` a string (the completions' tokens follow its own, EOS appended) or a list of chat
  messages (each completion is the assistant's answer, rendered with the chat template); or
  ``prompt_ids`` / ``completion_ids``, the token ids as generated (nothing appended), which is what
  per-token log-probabilities must be aligned with.
- ``rewards`` (normalised per group here: minus the group's mean, divided by its standard
  deviation + 1e-4 unless ``scale_rewards`` is "none", as TRL does) or ``advantages`` (as given).
- With token ids only: ``old_logps`` (the sampling policy's log-probability of each completion
  token: the ratio's denominator when the update is not on-policy) and ``ref_logps`` (the reference
  model's, for the KL term), one list per completion of its length.

Each completion is one row of ``seq_len`` tokens, right-padded, labels -100 on the prompt and the
padding; the per-token values sit at their tokens' positions (``old_logps`` / ``ref_token_logps``
[rows, seq_len]), the advantage once per row (``advantages`` [rows]). A row longer than
``seq_len`` is cut, or with ``drop_long`` left out.
"""

from __future__ import annotations

import torch

from .batches import BlockDataset
from .packing import PackStats, check_ids

SCALE_REWARDS = ("group", "none")


class RolloutEncoder:
    """A record -> its rows: ``(ids, loss mask, advantage, old log-probs or None, ref log-probs or
    None)`` per completion."""

    def __init__(self, tokenizer, template: str | None = None, scale_rewards: str = "group"):
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards {scale_rewards!r}: use one of {', '.join(SCALE_REWARDS)}")
        self.tokenizer, self.template, self.scale = tokenizer, template, scale_rewards
        self.eos = tokenizer.eos_token_id

    def __call__(self, record: dict, where: str) -> list[tuple]:
        given = "completion_ids" in record
        if not given and ("old_logps" in record or "ref_logps" in record):
            raise ValueError(
                f"{where}: old_logps / ref_logps are per token of the completions as generated: give "
                f"prompt_ids and completion_ids with them (re-tokenised text may not match the generation)"
            )
        prompt, completions = self._tokens(record, where) if given else self._texts(record, where)
        adv = self.advantages(record, len(completions), where)
        per_token = [self._per_token(record, key, completions, where) for key in ("old_logps", "ref_logps")]
        rows = []
        for k, c in enumerate(completions):
            old, ref = (None if p is None else p[k] for p in per_token)
            rows.append((prompt + c, [0] * len(prompt) + [1] * len(c), adv[k], old, ref))
        return rows

    def advantages(self, record: dict, n: int, where: str) -> list[float]:
        if ("rewards" in record) == ("advantages" in record):
            raise ValueError(f"{where}: give the completions' 'rewards' or their 'advantages' (one of the two)")
        key = "rewards" if "rewards" in record else "advantages"
        values = record[key]
        if not isinstance(values, list) or len(values) != n or not all(isinstance(v, int | float) for v in values):
            raise ValueError(f"{where}: {key!r} must be a list of {n} numbers (one per completion), got {values!r:.80}")
        x = torch.tensor(values, dtype=torch.float64)
        if key == "advantages":
            return x.tolist()
        x = x - x.mean()
        if self.scale == "group":
            x = x / ((x.std() if n > 1 else x.new_tensor(0.0)) + 1e-4)
        return x.tolist()

    def _texts(self, record: dict, where: str):
        prompt, completions = record.get("prompt"), record.get("completions")
        if not isinstance(completions, list) or not completions or not all(isinstance(c, str) for c in completions):
            raise ValueError(f"{where}: 'completions' must be a non-empty list of strings, got {completions!r:.80}")
        if isinstance(prompt, str):
            p = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            cs = self.tokenizer(completions, add_special_tokens=False)["input_ids"]
            return p, [c + [self.eos] for c in cs]
        from .records import chat_messages

        messages = chat_messages({"messages": prompt})
        if self.template is None:
            raise ValueError(f"{where}: a conversational prompt needs a chat template (--chat-template)")
        render = self.tokenizer.apply_chat_template
        before = list(render(messages, chat_template=self.template, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
        out = []
        for c in completions:
            full = list(render(messages + [{"role": "assistant", "content": c}], chat_template=self.template, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
            if full[: len(before)] != before:
                raise ValueError(f"{where}: the chat template renders the prompt differently once an answer follows")
            out.append(full[len(before) :])
        return before, out

    def _tokens(self, record: dict, where: str):
        prompt, completions = record.get("prompt_ids"), record.get("completion_ids")
        ok = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ok = ok and isinstance(completions, list) and completions
        ok = ok and all(isinstance(c, list) and c and all(isinstance(t, int) for t in c) for c in completions)
        if not ok:
            raise ValueError(
                f"{where}: 'prompt_ids' must be a list of token ids and 'completion_ids' a non-empty list of "
                f"non-empty lists of token ids"
            )
        return prompt, completions

    def _per_token(self, record: dict, key: str, completions, where: str):
        values = record.get(key)
        if values is None:
            return None
        lengths = [len(c) for c in completions]
        ok = isinstance(values, list) and [len(v) if isinstance(v, list) else -1 for v in values] == lengths
        if not ok or not all(isinstance(x, int | float) for v in values for x in v):
            raise ValueError(f"{where}: {key!r} must hold one list of numbers per completion, of its length {lengths}")
        return values


def load_rollouts(
    records, encoder: RolloutEncoder, seq_len: int, pad_id: int, drop_long: bool = False, vocab_size: int | None = None
):
    """Every completion of ``records`` as a row (module docstring): a ``BlockDataset``; a token id
    outside ``vocab_size`` is refused naming the record."""
    stats = PackStats(seq_len=seq_len)
    rows, seen = [], None
    for k, record in enumerate(records):
        where = f"record {k + 1}"
        stats.records += 1
        for ids, mask, adv, old, ref in encoder(record, where):
            check_ids(ids, vocab_size, where)
            has = (old is not None, ref is not None)
            if seen is not None and has != seen:
                raise ValueError(
                    f"{where}: old_logps / ref_logps given for some completions only; give them for all or none"
                )
            seen = has
            stats.tokens += len(ids)
            if len(ids) > seq_len:
                if drop_long:
                    stats.dropped += 1
                    continue
                stats.truncated += 1
            row = _row(ids[:seq_len], mask[:seq_len], seq_len, pad_id, old, ref)
            if bool((row["labels"] == -100).all()):
                stats.no_loss += 1
                continue
            stats.padding_tokens += seq_len - min(len(ids), seq_len)
            rows.append({**row, "advantages": torch.tensor(adv, dtype=torch.float32)})
    if not rows:
        raise ValueError(f"no completion fits --seq-len {seq_len} with a token left")
    fields = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    stats.blocks = len(rows)
    stats.loss_tokens = int((fields["labels"] != -100).sum())
    return BlockDataset(fields, stats)


def _row(ids, mask, seq_len: int, pad_id: int, old, ref) -> dict:
    row = torch.full((seq_len,), pad_id, dtype=torch.long)
    row[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    keep = torch.zeros(seq_len, dtype=torch.bool)
    keep[: len(mask)] = torch.tensor(mask, dtype=torch.bool)
    out = {"input_ids": row, "labels": row.masked_fill(~keep, -100)}
    start = len(mask) - sum(mask)  # the completion's first position
    for key, values in (("old_logps", old), ("ref_token_logps", ref)):
        if values is not None:
            x = torch.zeros(seq_len, dtype=torch.float32)
            n = min(len(values), seq_len - start)
            x[start : start + n] = torch.tensor(values[:n], dtype=torch.float32)
            out[key] = x
    return out
