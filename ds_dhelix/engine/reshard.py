"""Checkpoints that resume on another layout: TP, DP, EP, ZeRO stage (and world size) may change.

Every save writes, beside DeepSpeed's files, one small record per rank (``dhelix_layout_rank*.json``):
which part of each trained parameter's full HF tensor the rank holds (its ``hf_selection``, the
vocabulary padding), which DeepSpeed file holds its optimizer state and, for ZeRO's flat
partitions, the rank's place in each parameter group's partitioning group. From those:

    to_universal(root, tag, out)      offline, one process: every trained parameter's fp32 master
                                      and optimizer moments as full HF tensors (safetensors, one
                                      folder per kind), the step counters and the LR scheduler
    load_universal(engine, tag_dir)   on any layout: each rank reads its shards of those tensors
                                      (sliced reads) into its parameters, ZeRO's fp32 partitions
                                      and the optimizer state; the counters and the schedule

    <root>/<tag>/universal/
        fp32/  exp_avg/  exp_avg_sq/   *.safetensors, keyed by parameter name (full HF shape)
        state.pt                       optimizer step, counters, LR scheduler state, source layout

A resume whose parallel layout or ZeRO stage differs from the checkpoint's converts it once (rank
0, into the tag's ``universal/``) and loads that; ``dhelix convert-checkpoint`` does the
conversion offline. Frozen parameters (a LoRA base) are not in it: the run reads them from its
``--model`` as any start does. The folded pipeline's stages (PP) reshard like the rest: a stage's
records name its own parameters. What cannot be resharded (ZeRO-0 with expert parallelism, fp16
at ZeRO-0, a checkpoint written before these records) is refused in one line naming it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil

import torch
import torch.distributed as dist

RECORD = "dhelix_layout_rank{:04d}.json"
UNIVERSAL = "universal"
_FORMAT = 1
_SHARD_BYTES = 2 * 1024**3  # safetensors files of at most ~2 GB


# ------------------------------------------------------------------------------------ the record
def _selection_json(sel: dict | None) -> dict:
    out = {}
    for d, s in (sel or {}).items():
        out[str(d)] = [s.start, s.stop] if isinstance(s, slice) else {"index": [int(i) for i in s.tolist()]}
    return out


def _selection(js: dict) -> dict:
    return {int(d): (slice(*s) if isinstance(s, list) else torch.tensor(s["index"])) for d, s in js.items()}


def _partitioned(opt) -> bool:
    """ZeRO 1/2 and DeepSpeed's bf16 optimizer: flat fp32 partitions with per-parameter mappings."""
    return hasattr(opt, "real_dp_process_group")


def _zero3(opt) -> bool:
    """ZeRO-3: each parameter's partition in a sub-group's flat fp32 partition (``grad_position``)."""
    return hasattr(opt, "fp32_partitioned_groups_flat")


def _z3_place(opt, p) -> tuple[int, int, int, int, int]:
    """Where ZeRO-3 keeps this rank's partition of ``p``: (sub-group, offset in its flat fp32
    partition, partition size, partition rank, ``p``'s elements); the partition holds elements
    ``rank * size`` on of ``p`` flattened, padding past its end."""
    group, offset, size = opt.grad_position[opt.get_param_id(p)]
    return int(group), int(offset), int(size), dist.get_rank(p.ds_process_group), int(p.ds_numel)


def _z3_real(place) -> int:
    """Elements of a ZeRO-3 partition that are the parameter's (not padding)."""
    _, _, size, rank, numel = place
    return max(0, min(size, numel - rank * size))


def _z3_state_index(opt) -> list[int]:
    """Each sub-group's index in its optimizer's ``state_dict()`` (the fp32 flats, by param group)."""
    order = sorted(range(len(opt.fp16_groups)), key=lambda i: (opt.sub_group_to_group_id[i], i))
    index = [0] * len(order)
    for k, i in enumerate(order):
        index[i] = k
    return index


def layout_record(engine) -> dict:
    """What a conversion needs to know of this rank's part of a checkpoint (see the module doc)."""
    opt = engine.optimizer
    params = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            shard = getattr(p, "vocab_shard", None)
            params[name] = {
                "key": hf_name(name),
                "selection": _selection_json(getattr(p, "hf_selection", None)),
                "shape": list(getattr(p, "ds_shape", p.shape)),
                "real_rows": shard.real if shard is not None else None,
            }
    dtypes = sorted({str(p.dtype) for p in engine.module.parameters() if p.requires_grad})
    record = {"format": _FORMAT, "rank": dist.get_rank(), "world": dist.get_world_size(), "dtypes": dtypes,
              "zero_stage": int(engine.zero_optimization_stage()), "params": params}  # fmt: skip
    if _zero3(opt):
        record["optimizer"] = "zero3"
        record["file"] = os.path.basename(engine._get_zero_ckpt_name("", ""))
        record["zero3"] = {n: _z3_place(opt, p) for n, p in engine.module.named_parameters() if p.requires_grad}
        record["state_index"] = _z3_state_index(opt)
    elif _partitioned(opt):
        record["optimizer"] = "partitioned"
        record["file"] = os.path.basename(engine._get_zero_ckpt_name("", ""))
        record["partition_ranks"] = [dist.get_rank(g) for g in opt.real_dp_process_group]
    else:
        by_id = {id(p): n for n, p in engine.module.named_parameters()}
        order = [by_id.get(id(p)) for g in _base(opt).param_groups for p in g["params"]]
        sharded_experts = any(getattr(p, "ep_size", 1) > 1 for p in engine.module.parameters() if p.requires_grad)
        record["optimizer"] = "per-parameter" if None not in order else "unsupported"  # (fp16 ZeRO-0: copies)
        if sharded_experts:  # (DeepSpeed keeps each EP rank's expert state in its own files)
            record["optimizer"] = "unsupported-ep"
        record["file"] = os.path.basename(engine._get_ckpt_name("", ""))
        record["order"] = order
        pipe = getattr(engine.module, "hf_model", None) is not None  # (the folded pipeline: one file per stage)
        record["values_file"] = os.path.basename(engine.module._ckpt_path("")) if pipe else record["file"]
    return record


def records_differ(engine, tag_dir: str) -> bool:
    """The checkpoint at ``tag_dir`` was written at another layout, ZeRO stage or precision than
    ``engine``'s (its records say so, on any rank: collective, every rank gets the same answer);
    False without records (DeepSpeed's loader decides)."""
    if not glob.glob(os.path.join(tag_dir, "dhelix_layout_rank*.json")):
        return False
    path = os.path.join(tag_dir, RECORD.format(dist.get_rank()))
    differs = True  # (fewer ranks wrote it)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        mine = layout_record(engine)
        keys = ("world", "dtypes", "zero_stage", "params", "optimizer", "partition_ranks")
        differs = any(saved.get(k) != mine.get(k) for k in keys)
    flag = torch.tensor([float(differs)], device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def is_converted(tag_dir: str) -> bool:
    """A tag written by ``dhelix convert-checkpoint``: the universal folder, no DeepSpeed files."""
    return has_universal(tag_dir) and not glob.glob(os.path.join(tag_dir, "*model_states.pt"))


def hf_name(name: str) -> str:
    """A parameter's name in the HF model: the folded pipeline's module holds it as ``hf_model``."""
    return name.removeprefix("hf_model.")


def write_record(engine, tag_dir: str) -> None:
    with open(os.path.join(tag_dir, RECORD.format(dist.get_rank())), "w", encoding="utf-8") as f:
        json.dump(layout_record(engine), f)


def _base(opt):
    """The torch optimizer under DeepSpeed's wrappers."""
    return getattr(opt, "optimizer", opt)


# ------------------------------------------------------------------------------ what may change
RESHARDED = ("world", "dp", "tp", "pp", "ep", "cp")
"""Layout keys a resume reshards (with the ZeRO stage and fp16/bf16)."""


def needs_reshard(saved: dict, current: dict) -> bool:
    """The checkpoint's parallel layout or ZeRO stage differs from this run's."""
    a, b = saved.get("layout") or {}, current.get("layout") or {}
    pa, pb = saved.get("precision") or {}, current.get("precision") or {}
    precision = pa.get("zero_stage") != pb.get("zero_stage") or any(
        _enabled(pa.get(k)) != _enabled(pb.get(k)) for k in ("fp16", "bf16")
    )
    return precision or any(a.get(k, 1) != b.get(k, 1) for k in RESHARDED)


def _enabled(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def check_reshard(saved: dict, current: dict) -> None:
    """Before any model: ``ValueError`` naming what a resume on another layout (or micro-batch /
    GAS) cannot honour."""
    a, b = saved.get("layout") or {}, current.get("layout") or {}
    global_a = a.get("micro_batch_size", 0) * a.get("gradient_accumulation_steps", 0) * a.get("dp", 1)
    global_b = b.get("micro_batch_size", 0) * b.get("gradient_accumulation_steps", 0) * b.get("dp", 1)
    if global_a != global_b:
        gas = global_a / max(1, b.get("micro_batch_size", 1) * b.get("dp", 1))
        fix = f"gradient_accumulation_steps {int(gas)}" if gas == int(gas) and gas >= 1 else "a micro-batch and GAS"
        raise ValueError(
            f"a resume on another layout keeps the global batch (micro-batch x GAS x DP): the checkpoint's is "
            f"{global_a}, this run's {global_b}; set {fix} so that it stays {global_a} (the data position and the "
            f"LR schedule count steps of that batch)"
        )
    zero = (current.get("precision") or {}).get("zero_stage")
    if zero == 0 and b.get("ep", 1) > 1:
        raise ValueError(
            "a resume on another layout at ZeRO stage 0 with expert parallelism is not supported; use ZeRO stage 1 or 2"
        )
    if (saved.get("precision") or {}).get("zero_stage") == 0 and a.get("ep", 1) > 1:
        raise ValueError(
            "the checkpoint was written at ZeRO stage 0 with expert parallelism, whose expert optimizer state is not "
            "resharded; resume it on its own layout"
        )


# ------------------------------------------------------------------------------------ conversion
def has_universal(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, UNIVERSAL, "state.pt"))


def _records(tag_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(tag_dir, "dhelix_layout_rank*.json")))
    if not paths:
        raise ValueError(
            f"{tag_dir} has no shard layout records (dhelix_layout_rank*.json): it was written before "
            f"ds_dhelix could reshard checkpoints. Resume it on the layout that wrote it, or start from its "
            f"HF export (--model DIR)"
        )
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    return out


class _Pieces:
    """The pieces of every trained parameter's full tensors, as the ranks' files hold them."""

    def __init__(self):
        self.shards: dict[str, dict[str, dict]] = {}  # name -> selection key -> shard entry

    def entry(self, name: str, info: dict) -> dict:
        key = json.dumps(info["selection"], sort_keys=True)
        return self.shards.setdefault(name, {}).setdefault(key, {"info": info, "parts": {}})

    def full(self, name: str) -> torch.Tensor:
        """The full HF tensor of ``name`` from its shards (each the concatenation of its partition
        pieces in partition order, less the vocabulary padding)."""
        entries = list(self.shards[name].values())
        sels = [_selection(e["info"]["selection"]) for e in entries]
        shape = list(entries[0]["info"]["shape"])
        real0 = entries[0]["info"]["real_rows"]
        full_shape = [real0 if (d == 0 and real0 is not None) else n for d, n in enumerate(shape)]
        for d in range(len(shape)):
            ends = [(s[d].stop if isinstance(s[d], slice) else int(s[d].max()) + 1) for s in sels if d in s]
            full_shape[d] = max(ends) if ends else full_shape[d]
        out = torch.zeros(full_shape, dtype=torch.float32)
        seen = torch.zeros(full_shape, dtype=torch.bool)
        for e, sel in zip(entries, sels):
            parts = [e["parts"][r] for r in sorted(e["parts"])]
            flat = torch.cat(parts) if parts else torch.empty(0)
            want = math.prod(e["info"]["shape"])
            if flat.numel() != want:
                raise ValueError(f"{name}: the checkpoint holds {flat.numel()} of its {want} elements on one shard")
            shard = flat.view(e["info"]["shape"])
            if e["info"]["real_rows"] is not None:
                shard = shard[: e["info"]["real_rows"]]
            index = tuple(_as_slice_or_index(sel.get(d), full_shape[d], shard.shape[d]) for d in range(len(full_shape)))
            _assign(out, index, shard)
            _assign(seen, index, torch.ones_like(shard, dtype=torch.bool))
        if not bool(seen.all()):
            raise ValueError(f"{name}: the checkpoint's shards do not cover the whole tensor (a rank's files missing?)")
        return out


def _as_slice_or_index(sel, size: int, n: int):
    if sel is None:
        return slice(0, size)
    if isinstance(sel, slice):
        return slice(sel.start, sel.start + n)
    return sel[:n]


def _assign(out: torch.Tensor, index: tuple, value: torch.Tensor) -> None:
    """``out[index] = value``; ``index`` holds slices and at most one index tensor (rows picked)."""
    picks = [d for d, i in enumerate(index) if not isinstance(i, slice)]
    if not picks:
        out[index] = value
        return
    if len(picks) > 1:
        raise ValueError("a shard picked by rows along two dims cannot be placed")
    d = picks[0]
    view = out[tuple(slice(None) if k == d else i for k, i in enumerate(index))]
    view.index_copy_(d, index[d].long(), value)


def _kinds(records: list[dict], tag_dir: str) -> list[str]:
    """The optimizer-state tensors a parameter has besides its fp32 master (Adam: the moments)."""
    rec = records[0]
    sd = _load(os.path.join(tag_dir, rec["file"]))
    if rec["optimizer"] == "partitioned":
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"]
    elif rec["optimizer"] == "zero3":
        state = sd["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    else:
        state = (sd.get("optimizer") or {}).get("state") or {}
    first = next(iter(state.values()), {})
    return sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{path}: missing; the checkpoint is incomplete")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _collect(records: list[dict], tag_dir: str, kind: str) -> tuple[_Pieces, object]:
    """Every shard's pieces of ``kind`` ("fp32" or an optimizer-state key) and the optimizer step."""
    pieces, step = _Pieces(), None
    for rec in records:
        path = os.path.join(tag_dir, rec["file"])
        if rec["optimizer"] == "per-parameter" and not os.path.isfile(path):
            continue  # ZeRO-0: only the first DP rank of each model-parallel rank writes its file
        sd = _load(path)
        if rec["optimizer"] == "zero3":
            step = _collect_zero3(pieces, rec, sd["optimizer_state_dict"], kind, step)
        elif rec["optimizer"] == "partitioned":
            osd = sd["optimizer_state_dict"]
            flats = osd["single_partition_of_fp32_groups"]
            states = osd["base_optimizer_state"]["state"]
            for g, mapping in enumerate(osd["param_slice_mappings"]):
                flat = flats[g] if kind == "fp32" else states[g][kind]
                step = states[g].get("step", step)
                prank = rec["partition_ranks"][g]
                for name, frag in mapping.items():
                    e = pieces.entry(rec["params"][name]["key"], rec["params"][name])
                    e["parts"].setdefault(prank, flat.narrow(0, frag.start, frag.numel).float().clone())
        else:
            state, in_module = sd["optimizer"]["state"], rec["values_file"] == rec["file"]
            values = None
            if kind == "fp32":  # (the folded pipeline keeps each stage's weights in a file of its own)
                values = sd["module"] if in_module else _load(os.path.join(tag_dir, rec["values_file"]))
            for i, name in enumerate(rec["order"]):
                info = rec["params"][name]
                e = pieces.entry(info["key"], info)
                value = state[i][kind] if values is None else values[name if in_module else info["key"]]
                step = state[i].get("step", step)
                e["parts"].setdefault(0, value.float().flatten().clone())
    return pieces, step


def _collect_zero3(pieces: _Pieces, rec: dict, osd: dict, kind: str, step):
    """One ZeRO-3 rank's partitions of ``kind`` into ``pieces`` (padding left out); the step."""
    states = osd["optimizer_state_dict"]["state"]
    for name, place in rec["zero3"].items():
        group, offset, _, rank, _ = place
        state = states.get(rec["state_index"][group], {})
        step = state.get("step", step)
        flat = osd["fp32_flat_groups"][group] if kind == "fp32" else state[kind]
        e = pieces.entry(rec["params"][name]["key"], rec["params"][name])
        e["parts"].setdefault(rank, flat.narrow(0, offset, _z3_real(place)).float().clone())
    return step


def to_universal(root: str, tag: str, out_tag_dir: str | None = None, progress=None) -> str:
    """Write ``root/tag``'s trained state as full HF tensors (see the module doc) into
    ``out_tag_dir/universal`` (default: the tag's own). One process; returns the folder."""
    from safetensors.torch import save_file

    tag_dir = os.path.join(root, tag)
    records = _records(tag_dir)
    if any(r.get("format") != _FORMAT for r in records):
        raise ValueError(f"{tag_dir}: shard layout records of another format; convert with the version that wrote it")
    if any(r["optimizer"] == "unsupported-ep" for r in records):
        raise ValueError(
            f"{tag_dir} was written at ZeRO stage 0 with expert parallelism, whose expert optimizer state is not "
            f"resharded; resume it on its own layout (or train at ZeRO stage 1 or 2 to change layouts later)"
        )
    if any(r["optimizer"] == "unsupported" for r in records):
        raise ValueError(
            f"{tag_dir} was written with fp16 at ZeRO stage 0, whose optimizer state is not resharded; resume "
            f"it on its own layout"
        )
    out_tag_dir = out_tag_dir or tag_dir
    final = os.path.join(out_tag_dir, UNIVERSAL)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    kinds = ["fp32", *_kinds(records, tag_dir)]
    step = None
    for k, kind in enumerate(kinds):
        pieces, step = _collect(records, tag_dir, kind)
        os.makedirs(os.path.join(tmp, kind))
        batch, size, n = {}, 0, 0
        for i, name in enumerate(sorted(pieces.shards)):
            batch[name] = pieces.full(name)
            size += batch[name].numel() * 4
            if size >= _SHARD_BYTES:
                save_file(batch, os.path.join(tmp, kind, f"part-{n:05d}.safetensors"))
                batch, size, n = {}, 0, n + 1
            if progress is not None:
                progress(k * len(pieces.shards) + i + 1, len(kinds) * len(pieces.shards), f"{kind} {name}")
        if batch:
            save_file(batch, os.path.join(tmp, kind, f"part-{n:05d}.safetensors"))
    torch.save(_counters(tag_dir, records, step, kinds), os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def _counters(tag_dir: str, records: list[dict], step, kinds: list[str]) -> dict:
    names = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    names = names or sorted(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_model_states.pt")))  # (ZeRO-3's)
    if not names:
        raise ValueError(f"{tag_dir}: no DeepSpeed model-state file; the checkpoint is incomplete")
    sd = _load(names[0])
    run_state = {}  # (a checkpoint the HF Trainer wrote has none)
    if os.path.isfile(os.path.join(tag_dir, "dhelix_run_state.json")):
        with open(os.path.join(tag_dir, "dhelix_run_state.json"), encoding="utf-8") as f:
            run_state = json.load(f)
    return {
        "format": _FORMAT,
        "kinds": kinds,
        "optimizer_step": step,
        "global_steps": sd["global_steps"],
        "global_samples": sd.get("global_samples"),
        "skipped_steps": sd.get("skipped_steps", 0),
        "lr_scheduler": sd.get("lr_scheduler"),
        "run_state": run_state,
    }


def load_if_resharded(engine, root: str, tag: str) -> dict | None:
    """Collective: the resharded load of ``root/tag`` into ``engine`` when the checkpoint was
    converted offline or its shard records differ from the engine's (another layout, ZeRO stage or
    precision; converted first, once); its run state. None: DeepSpeed's own load fits."""
    tag_dir = os.path.join(root, tag)
    converted = is_converted(tag_dir)
    if not converted and not records_differ(engine, tag_dir):
        return None
    if not converted:
        convert_for_resume(root, tag)
    return load_universal(engine, tag_dir)


def convert_for_resume(root: str, tag: str) -> str:
    """Collective: rank 0 writes the tag's ``universal/`` unless it is there; every rank waits."""
    tag_dir = os.path.join(root, tag)
    err = None
    if dist.get_rank() == 0 and not has_universal(tag_dir):
        try:
            to_universal(root, tag)
        except ValueError as e:
            err = str(e)
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ValueError(box[0])
    return tag_dir


# ------------------------------------------------------------------------------------------ load
def load_universal(engine, tag_dir: str) -> dict:
    """Read ``tag_dir/universal`` into ``engine`` at its own layout (every rank); returns the
    checkpoint's run state. The step counters and the LR scheduler continue from it."""
    from hf_models.loading import CheckpointFiles, Key
    from hf_models.vocab import pad_rows

    folder = os.path.join(tag_dir, UNIVERSAL)
    meta = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=False)
    files = {kind: CheckpointFiles(os.path.join(folder, kind)) for kind in meta["kinds"]}
    opt = engine.optimizer
    if not _partitioned(opt) and engine.fp16_enabled():
        raise ValueError("a resume on another layout with fp16 at ZeRO stage 0 is not supported; use ZeRO stage 1 or 2")
    trained = {hf_name(n) for n, p in engine.module.named_parameters() if p.requires_grad}
    extra = sorted(set(files["fp32"].keys()) - trained)
    if extra and getattr(engine.module, "hf_model", None) is None:  # (a pipeline stage trains a part)
        raise ValueError(
            f"{tag_dir} does not fit this run's model: it trains {extra[0]}"
            + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
            + ", which this model does not (another model or adapter); resume with the model it trained, "
            "or start from its HF export (--model DIR)"
        )
    with torch.no_grad():
        for ds_name, p in engine.module.named_parameters():
            name = hf_name(ds_name)
            if not p.requires_grad:
                continue
            if name not in files["fp32"]:
                raise ValueError(
                    f"{tag_dir}: no {name} in the checkpoint: it was written for another model or adapter; "
                    f"resume with the model it trained, or start from its HF export (--model DIR)"
                )
            sel = getattr(p, "hf_selection", None) or {}
            _check_shape(files["fp32"], name, sel, p, tag_dir)
            shape = getattr(p, "ds_shape", p.shape)
            values = {k: pad_rows(p, f.read(Key(name), sel).float()).reshape(shape) for k, f in files.items()}
            if _zero3(opt):
                _set_zero3_state(opt, p, values, meta["optimizer_step"])
                continue
            p.data.copy_(values["fp32"].to(p.dtype))
            _set_state(opt, p, values, meta["optimizer_step"])
    _set_counters(engine, meta)
    return meta["run_state"]


def _check_shape(files, name: str, sel: dict, p, tag_dir: str) -> None:
    from hf_models.loading import Key, selected_shape
    from hf_models.vocab import real_shape

    full = files.shape(Key(name))
    if selected_shape(full, sel) != real_shape(p):
        raise ValueError(
            f"{tag_dir} does not fit this run's model: {name} is {full} in the checkpoint, this rank's "
            f"shard {list(p.shape)} is not part of it (another model?); resume with the model it trained"
        )


def _set_state(opt, p, values: dict, step) -> None:
    """``p``'s fp32 master and optimizer state: its fragment of the flat partition (ZeRO 1/2,
    bf16) or its own state (ZeRO-0, fp32)."""
    base = _base(opt)
    if _partitioned(opt):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return  # every element of p lies in another rank's partition
        lp, hp = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
        flat = _owner(base, mapping.hp_fragment)
        mapping.hp_fragment.copy_(values["fp32"].flatten().narrow(0, lp.start, lp.numel))
        state = base.state[flat]
        if mapping.optim_fragment is None:  # (DeepSpeed fills it at the first step)
            mapping.optim_fragment = {}
        for kind, value in values.items():
            if kind == "fp32":
                continue
            buf = state.setdefault(kind, torch.zeros_like(flat))
            buf.narrow(0, hp.start, hp.numel).copy_(value.flatten().narrow(0, lp.start, lp.numel))
            mapping.optim_fragment[kind] = buf.narrow(0, hp.start, hp.numel)
        state["step"] = _step_like(step)
        return
    state = base.state[p]
    for kind, value in values.items():
        if kind != "fp32":
            state[kind] = value.to(p.device).clone()
    state["step"] = _step_like(step)


def _set_zero3_state(opt, p, values: dict, step) -> None:
    """``p``'s ZeRO-3 partition: its low-precision partition (``ds_tensor``; a persistent
    parameter's whole copy too), its fp32 partition and optimizer state."""
    place = _z3_place(opt, p)
    group, offset, size, rank, _ = place
    real = _z3_real(place)
    part = {k: v.flatten().narrow(0, min(rank * size, v.numel()), real) for k, v in values.items()}
    p.ds_tensor.view(-1).narrow(0, 0, real).copy_(part["fp32"].to(p.ds_tensor.dtype))
    if p.data.numel() == p.ds_numel:  # (persistent: whole on every rank)
        p.data.copy_(values["fp32"].to(p.dtype))
    flat = opt.fp32_partitioned_groups_flat[group]
    flat.data.narrow(0, offset, real).copy_(part["fp32"].to(flat.device))
    state = _base(opt).state[flat]
    for kind, value in part.items():
        if kind != "fp32":
            state.setdefault(kind, torch.zeros_like(flat)).narrow(0, offset, real).copy_(value.to(flat.device))
    state["step"] = _step_like(step)


def _step_like(step):
    return step.clone() if torch.is_tensor(step) else step


def _owner(base, fragment: torch.Tensor) -> torch.Tensor:
    ptr = fragment.untyped_storage().data_ptr()
    for group in base.param_groups:
        for flat in group["params"]:
            if flat.untyped_storage().data_ptr() == ptr:
                return flat
    raise RuntimeError("no flat partition of the optimizer holds this parameter's fp32 fragment")


def _set_counters(engine, meta: dict) -> None:
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_samples"] or meta["global_steps"] * engine.train_batch_size()
    engine.skipped_steps = meta["skipped_steps"]
    sched, saved = engine.lr_scheduler, meta.get("lr_scheduler")
    if sched is not None and saved is not None:
        sched.load_state_dict(saved)
        last = getattr(sched, "last_batch_iteration", None)
        if last is not None:  # DeepSpeed's schedules: set the groups' LR of that step, as a native load has it
            sched.step(last)


def gather_universal(engine, kinds=("fp32", "exp_avg", "exp_avg_sq")) -> dict[str, dict[str, torch.Tensor]]:
    """The live engine's trained state as ``load_universal`` reads it: ``{kind: {name: full HF
    tensor}}`` (collective over every group; a pipeline stage's own parameters only; the check of
    what a resharded load carried over)."""
    from hf_models.common import gather_param

    from ..moe.experts import gather_expert_param, is_expert_param

    groups = getattr(engine, "groups", None)
    tp_group, tp = (groups.tp_grad_group, groups.tp_size) if groups is not None else (None, 1)
    opt, out = engine.optimizer, {k: {} for k in kinds}
    for ds_name, p in engine.module.named_parameters():
        name = hf_name(ds_name)
        if not p.requires_grad:
            continue
        for kind in kinds:
            local = _local_state(opt, p, kind)
            out[kind][name] = (
                gather_expert_param(p, local) if is_expert_param(p) else gather_param(p, tp_group, tp, data=local)
            )
    return out


def _local_state(opt, p, kind: str) -> torch.Tensor:
    """This rank's shard of ``p``'s fp32 master or optimizer state ``kind``, whole over ZeRO's
    partitions (collective over the partitioning group)."""
    if _zero3(opt):
        place = _z3_place(opt, p)
        group, offset, size, rank, numel = place
        flat = opt.fp32_partitioned_groups_flat[group]
        source = flat if kind == "fp32" else _base(opt).state[flat][kind]
        full = torch.zeros(numel, dtype=torch.float32, device=p.ds_tensor.device)
        full.narrow(0, rank * size, _z3_real(place)).copy_(source.narrow(0, offset, _z3_real(place)))
        dist.all_reduce(full, group=p.ds_process_group)
        return full.view(p.ds_shape)
    if not _partitioned(opt):
        return p.detach().float() if kind == "fp32" else _base(opt).state[p][kind]
    full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:
        lp, hp = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
        flat = _owner(_base(opt), mapping.hp_fragment)
        source = flat if kind == "fp32" else _base(opt).state[flat][kind]
        full.narrow(0, lp.start, lp.numel).copy_(source.narrow(0, hp.start, hp.numel))
    dist.all_reduce(full, group=p._dp_group)
    return full.view(p.shape)
