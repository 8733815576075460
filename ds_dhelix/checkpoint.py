"""Hugging Face checkpoints out of a (possibly TP-sharded) run.

``export_hf`` gathers every TP shard back into the full HF tensor, and global rank 0 writes a
``save_pretrained`` directory (safetensors, config, tokenizer) that plain transformers loads. The
directory is written under a temporary name beside the target and swapped in when complete, so a
crash never leaves a half-written checkpoint where a good one was, and no temporary directory
survives a failure. ``check_output_dir`` refuses a target that is not ours before any model is
built.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from hf_models.common import gather_param


def full_state_dict(model, tp_group=None, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter as its full HF tensor (collective over the TP group when sharded; expert
    shards are gathered over their EP group by global expert id)."""
    from .moe.experts import gather_expert_param, is_expert_param
    return {name: gather_expert_param(p) if is_expert_param(p) else gather_param(p, tp_group, tp_size)
            for name, p in model.named_parameters()}


def full_grads(model, groups) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as its full HF tensor, averaged over the data-parallel replicas
    (DeepSpeed's convention: expert gradients summed over their expert-data-parallel group, then
    divided by the whole DP size); no gradient counts as zeros. Collective over the TP, DP and EP
    groups of ``groups`` (a ``ProcessGroups``)."""
    from .moe.experts import gather_expert_param, is_expert_param
    dp, out = groups.dp_size, {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        sharded_experts = is_expert_param(p) and p.ep_size > 1
        reduce_over = groups.edp_group if sharded_experts else groups.dp_group
        if dp > 1 and dist.get_world_size(reduce_over) > 1:
            dist.all_reduce(g, group=reduce_over)
        g /= dp
        out[name] = gather_expert_param(p, g) if sharded_experts else \
            gather_param(p, groups.tp_grad_group, groups.tp_size, data=g)
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
        raise ValueError(f"{flag} {path!r} is a regular file; remove it, choose another path, or pass "
                         f"--overwrite-output-dir")
    if os.listdir(path) and not ours(path):
        raise ValueError(f"{flag} {path!r} is a non-empty directory that ds_dhelix did not write; choose another "
                         f"path or pass --overwrite-output-dir")


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


def _write_export(model, state: dict, out_dir: str, tokenizer, meta: dict) -> str:
    """Rank 0: the HF directory, written under a temporary name beside ``out_dir``, then published;
    a failure removes the temporary directory and leaves ``out_dir`` as it was."""
    import json

    from transformers import AutoModelForCausalLM
    fresh = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=next(iter(state.values())).dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or {})
    left = [k for k in missing if k not in tied]
    if left or unexpected:
        raise RuntimeError(f"state_dict mismatch on export: missing {left}, unexpected {unexpected}")
    fresh.tie_weights()
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    prefix = f".tmp-hf-{os.path.basename(out_dir)}@"  # "@": not the prefix of another export's name
    for name in os.listdir(parent):  # what an interrupted export left behind
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export gets the usual mode
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, EXPORT_MARK), "w") as f:
            json.dump(meta, f, indent=1)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_hf(model, out_dir: str, tokenizer=None, tp_group=None, tp_size: int = 1,
              meta: dict | None = None) -> str | None:
    """Write an HF checkpoint of ``model`` to ``out_dir``; returns the path on rank 0, else None.
    ``meta`` goes into the directory's ``dhelix_export.json`` (with the ds_dhelix version)."""
    from . import __version__
    state = full_state_dict(model, tp_group, tp_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        path = _write_export(model, state, out_dir, tokenizer, {"ds_dhelix": __version__, **(meta or {})})
    if dist.is_initialized():
        dist.barrier()
    return path
