"""The feature space, declared once as data, and a strength-2 covering array over it: every pair of
values of every two dimensions either in a row that runs end to end, or refused in one line by the
project's own checks, or beyond the test world.

    DIMENSIONS                   name, values (``make test``), more values (``make test-all``)
    allowed(row) -> None | str   None when the project's checks accept the row (``check_options``:
                                 ``check_setup``, the adapter's and the data's checks), else the
                                 line a user sees; "needs N ranks" beyond the 4-rank test world
    covering_array(full, seed,   Matrix: rows (dicts dimension -> value) covering every allowed pair
                   strength)     once at least (strength 3: every triple of STRENGTH_3's dimensions
                                 too); the refused pairs / triples with their lines; the others
    options(row)                 the row as ``ParityOptions``: SI (the row's schedule) against
                                 sequential, bitwise, and the unsharded HF model, close
    markdown(matrix)             the compatibility page (docs/reference/compatibility.md)

Whether a row is allowed is asked of the checks, not written here: a new refusal or feature
changes the matrix by itself. The generator is greedy and seeded (stable between runs): it takes
the first pair no row covers yet, tries completions of it, keeps the allowed one that covers most
new pairs; a pair no completion of which is allowed is refused (with the line of its first
completion) or, when only the world size stops it, beyond the test world.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, field

from .options import ParityOptions, check_options

MAX_WORLD = 4
"""The ranks a test world may have on the project's machine."""


@dataclass(frozen=True)
class Dimension:
    """One feature a user chooses: its values in ``make test`` and the ones ``make test-all`` adds."""

    name: str
    values: tuple
    more: tuple = ()
    doc: str = ""

    def of(self, full: bool) -> tuple:
        return self.values + (self.more if full else ())


DIMENSIONS = (
    Dimension("family", ("tiny-llama", "tiny-qwen3-moe"), ("tiny-deepseek-v3", "tiny-gpt2"), "dense or MoE preset"),
    Dimension("tp", (1, 2), (), "tensor-parallel size (with sequence parallelism)"),
    Dimension("ep", (1, 2), (), "expert-parallel size (inside the data-parallel group)"),
    Dimension("dp", (1, 2), (), "data-parallel size"),
    Dimension("context", ("none", "ulysses"), ("ring",), "context parallelism over 2 ranks and its exchange"),
    Dimension("pp", (1, 2), (), "pipeline stages (the fold)"),
    Dimension("zero", ("1", "2", "3"), ("0", "3+offload"), "ZeRO stage (3+offload: optimizer state on the CPU)"),
    Dimension("dtype", ("fp32", "bf16"), ("fp16",), "precision"),
    Dimension("recompute", ("none", "full"), ("selective",), "dhelix.recompute"),
    Dimension("schedule", ("si", "w"), ("si-ends", "intra", "dualpipev"), "compared with sequential"),
    Dimension("si_execution", ("reactive", "plan"), (), "how a pair runs"),
    Dimension("finetune", ("full", "lora"), (), "a full fine-tune or a PEFT LoRA adapter"),
    Dimension("packing", ("concat", "docs"), (), "token stream, or documents with positions and masks"),
    Dimension(
        "optimizer",
        ("AdamW", "Muon"),
        ("Adam", "SGD", "Lion"),
        "the ds_config's optimizer type (Lion: DeepSpeedCPULion under offload on a CPU)",
    ),
)
NAMES = tuple(d.name for d in DIMENSIONS)

Pair = tuple[str, object, str, object]  # (dimension, value, dimension, value), dimensions in NAMES order
Combination = tuple  # a pair, or a triple (dimension, value) x 3: what a row covers

STRENGTH_3 = ("zero", "tp", "dp", "pp", "finetune", "schedule")
"""The dimensions that interact most (the ZeRO stage, the parallel layout, the fine-tuning mode and
the schedule): the strength-3 array (``make test-all``) covers every triple of their values too."""


LORA_TARGETS = {"tiny-gpt2": ["c_attn"], "tiny-deepseek-v3": ["q_b_proj", "kv_b_proj"]}
"""LoRA's target modules where a family's attention does not name them q_proj / v_proj (MLA: the
up-projections of the query and the compressed key-value)."""


def default_row(full: bool = False) -> dict:
    return {d.name: d.of(full)[0] for d in DIMENSIONS}


def options(row: dict) -> ParityOptions:
    """The row as a parity run: 2 layers (4 in a pipeline: two chunks per stage), 2 steps of 4
    micro-batches of 2 x 32 tokens; the schedule's leg stopped after step 1 with a checkpoint and
    resumed by a new engine (held to the straight sequential run; not with CP: ``RESUME_UNDER_CP``),
    then exported and reloaded."""
    cp = 1 if row["context"] == "none" else 2
    zero = {"offload_optimizer": {"device": "cpu"}} if row["zero"] == "3+offload" else {}
    extra = {"si_execution": row["si_execution"]}
    if row["ep"] > 1:
        extra["expert_parallel"] = {"size": row["ep"]}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} if row["finetune"] == "lora" else {}
    if lora:  # the attention projections by each family's own names
        lora["target_modules"] = LORA_TARGETS.get(row["family"], lora["target_modules"])
    return ParityOptions(
        model=row["family"],
        tp=row["tp"],
        dp=row["dp"],
        pp=row["pp"],
        cp=cp,
        cp_comm="ulysses" if cp == 1 else row["context"],
        zero_stage=int(row["zero"][0]),
        zero=zero,
        dtype=row["dtype"],
        recompute=row["recompute"],
        schedule=row["schedule"],
        extra=extra,
        lora=lora,
        packing=row["packing"],
        optimizer=row["optimizer"],
        num_layers=4 if row["pp"] > 1 else 2,
        steps=2,
        micro_batches=4,
        micro_batch_size=2,
        seq_len=32,
        resume_at=0 if cp > 1 else 1,  # (resumed under CP: see RESUME_UNDER_CP)
        export=True,
    )


RESUME_UNDER_CP = (
    "a run with context parallelism resumed from its checkpoint can differ from the straight run by "
    "rounding (found by the matrix: Qwen3-MoE, EP=2 x DP=2 x CP=2, ZeRO-2: 7.5e-9 after the resumed "
    "step, bitwise without the stop); its rows run straight until the cause is found"
)
"""Why the rows with context parallelism are not stopped and resumed (docs/limitations.md)."""


@functools.cache
def _config(model: str, num_layers: int):
    from hf_models.registry import load_config, with_num_layers

    return with_num_layers(load_config(model), num_layers)


@functools.cache
def _allowed(key: tuple) -> str | None:
    opts = options(dict(zip(NAMES, key)))
    if opts.world > MAX_WORLD:
        return f"needs {opts.world} ranks (the test world has {MAX_WORLD})"
    try:
        check_options(opts, _config(opts.model, opts.num_layers))
    except ValueError as err:
        return " ".join(str(err).split())
    return None


def allowed(row: dict) -> str | None:
    """None when the project's checks accept ``row``; else the one line they refuse it with."""
    return _allowed(tuple(row[n] for n in NAMES))


def beyond_world(line: str | None) -> bool:
    return bool(line) and line.startswith("needs ") and "the test world" in line


def pairs_of(row: dict) -> set[Pair]:
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(NAMES, 2)}


def covered_by(row: dict, strength: int = 2) -> set[Combination]:
    """What ``row`` covers: its pairs, and at strength 3 its triples of ``STRENGTH_3``'s dimensions."""
    out: set = pairs_of(row)
    if strength == 3:
        dims = [n for n in NAMES if n in STRENGTH_3]  # (NAMES order, as all_combinations)
        out |= {(a, row[a], b, row[b], c, row[c]) for a, b, c in itertools.combinations(dims, 3)}
    return out


def all_pairs(full: bool = False) -> list[Pair]:
    dims = [(d.name, d.of(full)) for d in DIMENSIONS]
    return [(a, x, b, y) for (a, xs), (b, ys) in itertools.combinations(dims, 2) for x in xs for y in ys]


def all_combinations(full: bool = False, strength: int = 2) -> list[Combination]:
    """Every pair of values of every two dimensions; at strength 3 every triple of ``STRENGTH_3``'s too."""
    out: list = all_pairs(full)
    if strength == 3:
        dims = [(d.name, d.of(full)) for d in DIMENSIONS if d.name in STRENGTH_3]
        for (a, xs), (b, ys), (c, zs) in itertools.combinations(dims, 3):
            out += [(a, x, b, y, c, z) for x in xs for y in ys for z in zs]
    return out


def fixed_by(combination: Combination) -> dict:
    """``("tp", 2, "zero", "3")`` -> ``{"tp": 2, "zero": "3"}``."""
    return dict(zip(combination[::2], combination[1::2]))


@dataclass
class Matrix:
    """A covering array: ``rows`` (allowed, run end to end), ``refused`` (pair -> the line), and
    ``beyond`` (pairs only a world larger than the test's could hold)."""

    full: bool
    strength: int = 2
    rows: list[dict] = field(default_factory=list)
    refused: dict = field(default_factory=dict)
    beyond: dict = field(default_factory=dict)

    def covering(self, pair: Pair) -> int | None:
        """The number (1-based) of the first row that holds ``pair``."""
        return next((k + 1 for k, row in enumerate(self.rows) if pair in pairs_of(row)), None)


def _candidates(pair: Combination, rows: list[dict], rng: random.Random, full: bool, tries: int) -> list[dict]:
    """Completions of ``pair`` (or a triple) to try: the rows so far with it set in them (a refusal of
    one of those is about it), the defaults, then random ones."""
    fixed = fixed_by(pair)
    out = [{**row, **fixed} for row in rows] + [{**default_row(full), **fixed}]
    return out + [{d.name: rng.choice(d.of(full)) for d in DIMENSIONS} | fixed for _ in range(tries)]


def _repaired(row: dict, pair: Combination, full: bool) -> dict | None:
    """``row`` made allowed by changing one dimension other than the pair's (or triple's), or None."""
    for d in DIMENSIONS:
        if d.name in pair[::2]:
            continue
        for value in d.of(full):
            changed = {**row, d.name: value}
            if allowed(changed) is None:
                return changed
    return None


def _completion(pair: Combination, rows: list[dict], rng, full: bool, uncovered: set, tries: int, strength: int):
    """The allowed completion of ``pair`` covering most uncovered pairs (None if there is none
    among the candidates and their one-dimension repairs), and the line the first candidate was
    refused with."""
    candidates = _candidates(pair, rows, rng, full, tries)
    ok = [row for row in candidates if allowed(row) is None]
    if not ok:
        ok = [r for r in (_repaired(row, pair, full) for row in candidates[: len(rows) + 1 + tries // 4]) if r]
    best = max(ok, key=lambda row: len(covered_by(row, strength) & uncovered), default=None)
    return best, allowed(candidates[0]) or ""


@functools.cache
def covering_array(full: bool = False, seed: int = 0, tries: int = 60, strength: int = 2) -> Matrix:
    """Rows covering every pair of values some allowed row can hold (strength 2; strength 3: every
    triple of ``STRENGTH_3``'s dimensions too), few of them. Cached: treat it as read-only."""
    rng = random.Random(seed)
    matrix = Matrix(full, strength)
    targets = all_combinations(full, strength)
    uncovered = set(targets)
    for pair in targets:  # (a stable order: the first uncovered pair, then triple, next)
        if pair not in uncovered:
            continue
        row, refusal = _completion(pair, matrix.rows, rng, full, uncovered, tries, strength)
        if row is None:
            (matrix.beyond if beyond_world(refusal) else matrix.refused)[pair] = refusal
            uncovered.discard(pair)
            continue
        matrix.rows.append(row)
        uncovered -= covered_by(row, strength)
    for pair in matrix.refused:
        matrix.refused[pair] = _why(pair, matrix.rows) or matrix.refused[pair]
    return matrix


WORDS = {
    "family": ("model_type", "model", "experts"),
    "tp": ("tensor_parallel", "tp "),
    "ep": ("expert_parallel", "ep "),
    "dp": ("data-parallel",),
    "context": ("context_parallel", "ulysses", "ring"),
    "pp": ("pipeline", "--pp"),
    "zero": ("zero_optimization", "ZeRO"),
    "dtype": ("bf16", "fp16"),
    "recompute": ("recompute",),
    "schedule": ("schedule",),
    "si_execution": ("si_execution",),
    "finetune": ("LoRA", "lora", "adapter"),
    "packing": ("packing", "documents"),
    "optimizer": ('"optimizer"', "Muon", "Lion"),
}
"""How a refusal line names a dimension (the one that names both of a pair's is about the pair)."""


def _why(pair: Combination, rows: list[dict]) -> str | None:
    """The line about ``pair`` (or a triple): the allowed rows with it set in them (and each with one
    other dimension moved), refused; of their lines the one naming most of its dimensions, then the
    most common."""
    import collections

    fixed = fixed_by(pair)
    lines = collections.Counter()
    for row in rows:
        base = {**row, **fixed}
        tried = [base] + [{**base, d.name: v} for d in DIMENSIONS if d.name not in fixed for v in d.values]
        for candidate in tried:
            line = allowed(candidate)
            if line and not beyond_world(line):
                lines[line] += 1

    def names(line: str, dim: str) -> bool:
        return any(w in line for w in WORDS[dim])

    return max(lines, key=lambda line: (sum(names(line, dim) for dim in fixed), lines[line]), default=None)


def one_stage_groups(matrix: Matrix) -> dict[int, list[ParityOptions]]:
    """The one-stage rows' parity runs by world size (one spawned world each: ``run_parities``)."""
    groups: dict[int, list[ParityOptions]] = {}
    for row in matrix.rows:
        opts = options(row)
        if opts.pp == 1:
            groups.setdefault(opts.world, []).append(opts)
    return groups


def pipeline_runs(matrix: Matrix) -> list[ParityOptions]:
    return [options(row) for row in matrix.rows if row["pp"] > 1]


def _cell(value) -> str:
    return str(value)


def markdown(matrix: Matrix) -> str:
    """The compatibility page: the dimensions, the rows, then for every two dimensions which value
    pairs a row covers (✔ and the row), which the checks refuse (✘ and the line) and which only a
    world larger than the test's could hold (–)."""
    dims = [(d, d.of(matrix.full)) for d in DIMENSIONS]
    lines = ["| dimension | values | |", "|---|---|---|"]
    lines += [f"| `{d.name}` | {', '.join(f'`{v}`' for v in values)} | {d.doc} |" for d, values in dims]
    lines += ["", f"{len(matrix.rows)} rows cover every allowed pair:", ""]
    lines += ["| row | " + " | ".join(NAMES) + " |", "|---" * (len(NAMES) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(_cell(row[n]) for n in NAMES) + " |" for k, row in enumerate(matrix.rows, 1)]
    refusals = sorted(set(matrix.refused.values()))
    lines += ["", "Refused, each in one line before any model:", ""]
    lines += [f"- **R{k}**: {line}" for k, line in enumerate(refusals, 1)]
    for (da, xs), (db, ys) in itertools.combinations(dims, 2):
        lines += ["", f"### `{da.name}` × `{db.name}`", "", f"| | {' | '.join(f'`{y}`' for y in ys)} |"]
        lines.append("|---" * (len(ys) + 1) + "|")
        for x in xs:
            cells = []
            for y in ys:
                pair = (da.name, x, db.name, y)
                if pair in matrix.refused:
                    cells.append(f"✘ R{refusals.index(matrix.refused[pair]) + 1}")
                elif pair in matrix.beyond:
                    cells.append("–")
                else:
                    cells.append(f"✔ {matrix.covering(pair)}")
            lines.append(f"| `{x}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
