"""Shared test helpers: multi-process worlds (``run_ranks``), the small dense HF models and
micro-batches the adapter and executor tests compare against, and the ``gpu`` marker's skip.

Tests import helpers with ``from tests.conftest import ...``.
"""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

from ds_dhelix.runtime.comm import SHM_BUFFER_PREFIX
from ds_dhelix.runtime.spawn import free_port, run_ranks  # noqa: F401  (re-exported for the tests)
from hf_models.common import gather_param
from hf_models.registry import load_config

SEED, BATCH, SEQ = 0, 2, 16


@pytest.fixture(autouse=True)
def _no_deepspeed_shm_left_behind():
    """DeepSpeed's CPU all-reduce leaves a ~69 MB /dev/shm file per rank and port; ds_dhelix's
    builds release theirs (``comm.release_deepspeed_shm``), plain ``deepspeed.initialize`` runs in
    tests do not: what a test's processes left is removed after it (they have exited by then)."""

    def ours():
        return set(glob.glob(f"/dev/shm/{SHM_BUFFER_PREFIX}_{os.getuid()}_*"))

    before = ours()
    yield
    for path in ours() - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need a CUDA device: skipped without one, never failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
"""Config lists with one entry per decoder layer."""


def make_config(preset: str, attn: str = "sdpa", **overrides):
    """A preset's config with 2 layers (the op list of a layer does not change) and ``overrides``."""
    config = load_config(preset)
    config.num_hidden_layers = 2
    for key in PER_LAYER_KEYS:  # one entry per layer: the first two
        if getattr(config, key, None) is not None:
            setattr(config, key, list(getattr(config, key))[:2])
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    return config


def make_model(config):
    """The HF model of ``config``, seeded, in train mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), dtype=torch.float32, attn_implementation=config._attn_implementation
        )
    return model.train()


def make_batches(vocab: int, num: int) -> list[dict]:
    """``num`` micro-batches of [BATCH, SEQ] random ids; the first masks its first targets."""
    from ds_dhelix.verify import random_batches

    batches = random_batches(vocab, num, BATCH, SEQ)
    if batches:
        batches[0]["labels"][0, :5] = -100  # ignored targets (prompt masking)
    return batches


def hf_reference(model, batches):
    """HF losses of each micro-batch; gradients of their mean accumulated in ``model``."""
    losses = []
    for b in batches:
        loss = model(**b).loss
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return losses


def gathered_grad(p, group, tp):
    """The full HF-shaped gradient of a (possibly TP-sharded) parameter."""
    return gather_param(p, group, tp, data=p.grad.detach())


def process_groups(tp: int = 1, ep: int = 1):
    """``ProcessGroups`` of the running world with TP ``tp`` and EP ``ep`` (inside a rank)."""
    import torch.distributed as dist

    from ds_dhelix.config.dims import ParallelDims
    from ds_dhelix.runtime.groups import ProcessGroups

    return ProcessGroups.create(ParallelDims(dist.get_world_size(), tp=tp, ep=ep))


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """``straight_run(layout)``: one uninterrupted ``train.py`` run per layout of
    ``tests.test_long_job.LAYOUTS`` (TOTAL steps through the DeepSpeed launcher, a checkpoint every
    STOP steps, the HF export), made the first time a test asks for it and shared by the tests that
    compare against it (exact resume, training from a checkpoint directory, refused resumes).
    Returns ``{"cfg", "ck", "summary", "weights"}``."""
    from tests.test_long_job import LAYOUTS, STOP, TOTAL, _cmd, _config, _ok, _run, _summary, _weights

    runs = {}

    def get(layout: str) -> dict:
        if layout not in runs:
            name, model = LAYOUTS[layout]
            tmp = tmp_path_factory.mktemp(f"straight-{layout}")
            cfg, ck = _config(tmp, name), tmp / "ck"
            _ok(
                _run(
                    _cmd(
                        cfg,
                        model,
                        tmp / "hf",
                        "--steps",
                        str(TOTAL),
                        "--save-interval",
                        str(STOP),
                        "--ds-checkpoint",
                        str(ck),
                        "--json-summary",
                        str(tmp / "summary.json"),
                    )
                )
            )
            runs[layout] = {
                "cfg": cfg,
                "ck": ck,
                "summary": _summary(tmp / "summary.json"),
                "weights": _weights(tmp / "hf"),
            }
        return runs[layout]

    return get
