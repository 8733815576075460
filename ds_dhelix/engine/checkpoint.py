"""Hugging Face checkpoints out of a (possibly TP-sharded) run.

``export_hf`` gathers every TP shard back into the full HF tensor, and global rank 0 writes a
``save_pretrained`` directory (safetensors, config, tokenizer) that plain transformers loads. The
directory is written under a temporary name beside the target and swapped in when complete, so a
crash never leaves a half-written checkpoint where a good one was, and no temporary directory
survives a failure. ``check_output_dir`` refuses a target that is not ours before any model is
built.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from hf_models.common import gather_param


def full_state_dict(model, tp_group=None, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter as its full HF tensor (collective over the TP group when sharded; expert
    shards are gathered over their EP group by global expert id)."""
    return {name: whole_tensor(p, tp_group, tp_size) for name, p in model.named_parameters()}


def whole_tensor(p, tp_group=None, tp_size: int = 1) -> torch.Tensor:
    """``p`` as its full HF tensor: gathered over ZeRO-3's partition group (a copy of its own),
    then over the TP group or its experts' EP group; collective."""
    from ..moe.experts import gather_expert_param, is_expert_param
    from .zero3 import gathered

    with gathered(p) as partitioned:
        full = gather_expert_param(p) if is_expert_param(p) else gather_param(p, tp_group, tp_size)
        return full.clone() if partitioned else full


def full_grads(model, groups) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as its full HF tensor, averaged over the data-parallel replicas
    (DeepSpeed's convention: expert gradients summed over their expert-data-parallel group, then
    divided by the whole DP size); no gradient counts as zeros. Collective over the TP, CP, DP and EP
    groups of ``groups`` (a ``ProcessGroups``). With context parallelism each rank's gradient (the
    loss seeded 1/m, as here) is its sequence shard's share: they are summed over the CP group."""
    from ..moe.experts import gather_expert_param, is_expert_param

    dp, out = groups.dp_size, {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        sharded_experts = is_expert_param(p) and p.ep_size > 1
        if groups.cp_size > 1 and not sharded_experts:  # (expert-data-parallel groups span CP already)
            dist.all_reduce(g, group=groups.cp_group)
        reduce_over = groups.edp_group if sharded_experts else groups.dp_group
        if dist.get_world_size(reduce_over) > 1:
            dist.all_reduce(g, group=reduce_over)
        g /= dp
        out[name] = (
            gather_expert_param(p, g)
            if sharded_experts
            else gather_param(p, groups.tp_grad_group, groups.tp_size, data=g)
        )
    return out


EXPORT_MARK = "dhelix_export.json"
"""Written into every HF export: marks the directory as one a later run may replace."""


def check_output_dir(path: str, flag: str, overwrite: bool = False, ours=lambda p: False) -> None:
    """Before any model is built: ``path`` can be written as a run's output. Its parent must be a
    directory we can write; ``path`` absent, an empty directory or one of ours (``ours(path)``); a
    regular file or a foreign non-empty directory is refused unless ``overwrite``."""
    path = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(path)
    probe = parent
    while not os.path.exists(probe):  # the nearest existing ancestor must be a writable directory
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise ValueError(f"{flag} {path!r}: {probe!r} {what}; choose another location")
    if not os.path.exists(path) or overwrite:
        return
    if not os.path.isdir(path):
        raise ValueError(
            f"{flag} {path!r} is a regular file; remove it, choose another path, or pass --overwrite-output-dir"
        )
    if os.listdir(path) and not ours(path):
        raise ValueError(
            f"{flag} {path!r} is a non-empty directory that ds_dhelix did not write; choose another "
            f"path or pass --overwrite-output-dir"
        )


def is_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, EXPORT_MARK))


def _exchange(a: str, b: str) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    except (OSError, AttributeError):
        return False


_exchange_for_test = _exchange  # the tests check the system call itself


def publish_dir(tmp: str, target: str) -> None:
    """Put the complete directory ``tmp`` at ``target``: a rename when nothing is there, else an atomic
    exchange (the previous one stays readable until the new one is in place), then the old one is
    removed."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if not os.path.isdir(target) or os.path.islink(target):
        os.remove(target)  # a file in the way (refused up front unless --overwrite-output-dir)
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):
        shutil.rmtree(tmp)  # now the previous directory
        return
    old = tmp + ".old"  # no atomic exchange here: two renames, the previous one put back on failure
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old)


def parse_size(text, flag: str = "max_shard_size") -> int:
    """Bytes of a size such as ``"5GB"``, ``"500MB"``, ``"200KB"`` or an int (as transformers'
    ``max_shard_size`` reads it: decimal units, "GiB"/"MiB" binary)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r}: use a size such as 500MB or 5GB")
    unit = (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(float(m.group(1)) * scale)


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ShardWriter:
    """safetensors files of at most ``max_bytes`` each (a larger tensor gets a file of its own),
    written tensor by tensor: each tensor's bytes go straight to disk, so memory holds one tensor
    at a time whatever the shard size. ``close`` names the files as ``save_pretrained`` does and
    writes the index when there are several."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.entries: dict[str, dict] = {}  # the open file's header entries
        self.data = None  # the open file's tensor bytes (a side file until the header is known)
        self.size = 0
        self.files: list[list[str]] = []  # keys of each finished file
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.entries and self.size + size > self.max_bytes:
            self._finish_file()
        if self.data is None:
            self.data = open(os.path.join(self.directory, f"part-{len(self.files)}.data"), "wb")
        t = tensor.detach().contiguous().cpu()
        self.data.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        self.entries[key] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self.size, self.size + size],
        }
        self.size += size
        self.total += size

    def _finish_file(self) -> None:
        """The open file's header, then its bytes (copied from the side file in blocks)."""
        import json
        import struct

        data_path = self.data.name
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the tensor bytes start 8-aligned
        with (
            open(os.path.join(self.directory, f"part-{len(self.files)}.safetensors"), "wb") as out,
            open(data_path, "rb") as data,
        ):
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, 16 << 20)
        os.remove(data_path)
        self.files.append(list(self.entries))
        self.entries, self.data, self.size = {}, None, 0

    def close(self) -> list[str]:
        import json

        from hf_models.loading import INDEX_FILE, SINGLE_FILE

        if self.data is None and not self.files:
            raise RuntimeError("HF export: no tensors to write")
        if self.data is not None:
            self._finish_file()
        n = len(self.files)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.rename(os.path.join(self.directory, f"part-{i}.safetensors"), os.path.join(self.directory, name))
        if n > 1:
            weight_map = {key: name for name, keys in zip(names, self.files) for key in keys}
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return names


def _temp_dir(out_dir: str) -> str:
    """A fresh temporary directory beside ``out_dir`` (what an interrupted export left is removed)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    prefix = f".tmp-hf-{os.path.basename(out_dir)}@"  # "@": not the prefix of another export's name
    for name in os.listdir(parent):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export gets the usual mode
    return tmp


def _write_side_files(model, tmp: str, tokenizer, meta: dict, dtype) -> None:
    import copy
    import json

    config = copy.deepcopy(model.config)
    config.dtype = dtype  # the dtype the tensors were written in (a bf16 run exports bf16)
    _fill_special_ids(config, tokenizer)
    config.save_pretrained(tmp)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation = copy.deepcopy(generation)
        _fill_special_ids(generation, tokenizer)
        generation.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, EXPORT_MARK), "w") as f:
        json.dump(meta, f, indent=1)


def _fill_special_ids(config, tokenizer) -> None:
    """The tokenizer's bos / eos / pad ids into ``config`` (a model or generation config) where it
    has none, so generation with the export stops where the data's documents did."""
    if tokenizer is None:
        return
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if getattr(config, key, None) is None and value is not None:
            setattr(config, key, value)


def hf_tensors(model, tp_group=None, tp_size: int = 1, only=None):
    """``(name, full HF tensor)`` for every parameter and persistent buffer (``only(name)``: those
    it accepts), gathered one at a time (collective over the TP group, experts over their EP group): the export never
    holds more than one full tensor."""
    from hf_models.loading import persistent_buffers

    for name, p in model.named_parameters():
        if only is None or only(name):
            yield name, whole_tensor(p, tp_group, tp_size)
    for name, buf in persistent_buffers(model):  # whole on every rank (e_score_correction_bias)
        if only is None or only(name):
            yield name, buf.detach().clone()


def model_tensors(model, stream):
    """What an HF export writes of ``stream``: a LoRA model's factors merged into their base weights
    (``hf_models.lora.merged_stream``), any other model's tensors as they are."""
    from hf_models.lora import merged_stream

    info = getattr(model, "dhelix_lora", None)
    return stream if info is None else merged_stream(stream, info)


ADAPTER_FILE = "adapter_model.safetensors"


def export_adapter(
    model, out_dir: str, stream, base: str | None = None, tokenizer=None, meta: dict | None = None
) -> str | None:
    """Write a LoRA model's adapter as PEFT saves one (``adapter_config.json``, ``adapter_model.safetensors``
    with PEFT's keys) to ``out_dir`` from global rank 0 (collective: ``stream`` yields the factors'
    full tensors, see ``hf_tensors(only=...)``); ``PeftModel.from_pretrained(base_model, out_dir)``
    loads it. ``base``: the base model's path, recorded as ``base_model_name_or_path``; ``tokenizer``:
    saved beside it."""
    import copy
    import json

    from safetensors.torch import save_file

    from hf_models.lora import adapter_file_tensor

    from .. import __version__

    info = getattr(model, "dhelix_lora", None)
    if info is None:
        raise ValueError("export_adapter: the model has no LoRA adapter (initialize was given no PEFT model)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, error, path = {}, None, None
    with torch.no_grad():
        for name, full in stream:
            if rank == 0:
                key, tensor = adapter_file_tensor(name, full.detach().cpu(), info)
                tensors[key] = tensor.contiguous()
    if rank == 0:
        tmp = None
        try:
            tmp = _temp_dir(out_dir)
            save_file(tensors, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
            config = copy.deepcopy(info.config)
            config.base_model_name_or_path = base or config.base_model_name_or_path
            config.inference_mode = True
            config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, EXPORT_MARK), "w") as f:
                json.dump({"ds_dhelix": __version__, "adapter": True, **(meta or {})}, f, indent=1)
            publish_dir(tmp, out_dir)
            path = os.path.abspath(out_dir)
        except BaseException as err:  # noqa: B036 - raised on every rank by agree_on_failure
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            error = err
    agree_on_failure(error)
    return path


class ExportWriter:
    """Global rank 0's side of a streamed export: full tensors in, the files ``save_pretrained``
    writes out (per-expert tensors where the family stores them so), under a temporary directory
    published when complete. A failure is kept, not raised, until every rank has finished its
    gathers (``finish``), so no rank is left waiting in a collective."""

    def __init__(self, model, out_dir: str, tokenizer, meta: dict, max_shard_size):
        self.model, self.out_dir, self.tokenizer, self.meta = model, os.path.abspath(out_dir), tokenizer, meta
        self.error: BaseException | None = None
        self.tmp, self.dtype = None, None
        self.names: list[str] = []
        try:
            self.tmp = _temp_dir(out_dir)
            self.shards = ShardWriter(self.tmp, parse_size(max_shard_size))
        except BaseException as err:  # noqa: B036 - reported by finish() on every rank
            self.error = err

    def add(self, name: str, full: torch.Tensor) -> None:
        from hf_models.loading import checkpoint_source, file_tensors

        if self.error is not None:
            return
        self.dtype = self.dtype or full.dtype
        try:
            for key, tensor in file_tensors(checkpoint_source(self.model, name), full):
                self.shards.add(key, tensor)
            self.names.append(name)
        except BaseException as err:  # noqa: B036
            self.error = err

    def finish(self) -> str:
        try:
            if self.error is not None:
                raise self.error
            self._check_complete()
            self.shards.close()
            _write_side_files(self.model, self.tmp, self.tokenizer, self.meta, self.dtype)
            publish_dir(self.tmp, self.out_dir)
        except BaseException:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self.out_dir

    def _check_complete(self) -> None:
        from hf_models.loading import empty_model, persistent_buffers

        empty = empty_model(None, config=self.model.config)
        whole = {n for n, _ in empty.named_parameters()} | {n for n, _ in persistent_buffers(empty)}
        missing, unexpected = sorted(whole - set(self.names)), sorted(set(self.names) - whole)
        if missing or unexpected:
            raise RuntimeError(
                f"HF export does not cover the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )


def agree_on_failure(error: BaseException | None) -> None:
    """Collective: raise on every rank when any rank failed (the failing rank re-raises its own)."""
    failed = torch.tensor([error is not None], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed):
        raise RuntimeError(
            "the HF export failed on another rank (its error is printed there); the previous "
            "export, if any, is untouched"
        )


def export_hf(
    model,
    out_dir: str,
    tokenizer=None,
    tp_group=None,
    tp_size: int = 1,
    meta: dict | None = None,
    max_shard_size="5GB",
    tensors=None,
) -> str | None:
    """Write an HF checkpoint of ``model`` to ``out_dir``, streamed: each full tensor is gathered,
    written by global rank 0 into safetensors files of at most ``max_shard_size`` and dropped
    (collective; ``tensors``: the ``(name, full tensor)`` stream, default :func:`hf_tensors`).
    Returns the path on rank 0, else None. ``meta`` goes into ``dhelix_export.json``."""
    from .. import __version__

    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = (
        ExportWriter(model, out_dir, tokenizer, {"ds_dhelix": __version__, **(meta or {})}, max_shard_size)
        if rank == 0
        else None
    )
    with torch.no_grad():
        for name, full in model_tensors(
            model, tensors if tensors is not None else hf_tensors(model, tp_group, tp_size)
        ):
            if writer is not None:
                writer.add(name, full)
    error, path = None, None
    if writer is not None:
        try:
            path = writer.finish()
        except BaseException as err:  # noqa: B036
            error = err
    agree_on_failure(error)
    return path
