"""The one build path: an HF causal LM and a ds_config with a "dhelix" section become an engine.

    check_setup(ds_config, model_config, world)   every check that needs no model -> Setup
    shard_model(model, dh, dims, groups)          this rank's shards and the op graph
    build_engine(model, ds_config, ...)           DhelixEngine | DhelixMoeEngine | FoldedPipelineEngine
    initialize(...)                               ``deepspeed.initialize``'s signature and return value

``train.py``, ``ds_dhelix.initialize``, the ``dhelix`` commands (parity, profile, validate-plan,
bench, trace) and the pipeline all come through here::

    ds_config ─► DhelixConfig ─► ParallelDims ─► checks (model shape, batch, schedule, pipeline)
    model ─► ProcessGroups ─► adapter.build_graph (TP/EP shards) ─► SI plan ─► engine class
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from hf_models.adapters import check_model, unwrap_peft
from hf_models.lora import factors as lora_factors
from hf_models.lora import use_dropout as use_lora_dropout

from ..config.dims import ParallelDims
from ..config.ds_keys import check_deepspeed_keys
from ..config.ds_settings import DeepSpeedSettings
from ..config.section import (
    ONE_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    BatchSizes,
    DhelixConfig,
    derive_batch,
    load_ds_config,
)
from ..graph.fuse import fuse
from ..graph.objectives import make_objective
from ..graph.ops import backward_order
from ..moe.kernels import check_kernels
from ..pipe.folding import LayerFold, fold_layers
from ..planning.plan import SIPlan, default_plan
from ..runtime.comm import ReplicatedGrads, release_deepspeed_shm
from ..runtime.groups import ProcessGroups
from ..schedule.registry import PIPELINE, lookup
from .precision import check_fp16


@dataclass(frozen=True)
class Setup:
    """What the checks before any model is built establish."""

    dh: DhelixConfig
    ds: DeepSpeedSettings  # the DeepSpeed settings, parsed once
    dims: ParallelDims
    batch: BatchSizes
    fold: LayerFold | None  # the layer fold of a pipeline (pp > 1)
    given: frozenset[str] = frozenset()  # the keys the dhelix section sets


def check_setup(ds_config: dict, model_config, world: int, client_optimizer: bool = False) -> Setup:
    """Every mistake that can be found without a model, as one ``ValueError`` naming the values and
    the fix: top-level keys DeepSpeed does not read, the dhelix section, parallel sizes against the
    world and the model's shape, the batch arithmetic, ZeRO, the schedule, the pipeline's fold and
    micro-batch count. ``client_optimizer``: the caller passes its own optimizer. The checks below
    read the typed views (``DhelixConfig``, ``DeepSpeedSettings``), never the dict."""
    dh = DhelixConfig.from_ds_config(ds_config)
    given = frozenset(ds_config.get("dhelix") or {})
    ds = DeepSpeedSettings.from_ds_config(ds_config)
    check_deepspeed_keys(ds.keys, dh.allow_unknown_deepspeed_keys)
    _check_sections(ds, dh, given)
    dims = ParallelDims.from_config(dh, world)
    batch = derive_batch(ds_config, dims)
    _check_zero(ds, dh, client_optimizer)
    check_fp16(ds.fp16)
    if not dh.enabled:
        return Setup(dh, ds, dims, batch, None, given)
    adapter = check_model(dims, model_config)
    ep = dh.expert_parallel
    if not hasattr(adapter, "check_ep") and (ep.capacity_factor is not None or ep.aux_loss_coef is not None):
        raise ValueError(
            f"dhelix.expert_parallel is set but model_type {model_config.model_type!r} has no "
            f"experts; remove the section or use an MoE model (e.g. tiny-phimoe)"
        )
    if hasattr(adapter, "check_aux"):
        adapter.check_aux(ep.aux_loss_coef)
    _check_moe_kernels(ds, dh, adapter, model_config)
    _check_not_yet(ds)
    _check_optimizer(ds, dims)
    fold = None
    if dims.pp == 1 and dh.schedule not in ONE_STAGE_SCHEDULES:
        raise ValueError(
            f"dhelix.schedule = {dh.schedule!r} folds the model over pipeline ranks: set "
            f"dhelix.pipeline.stages >= 2, or use one of {list(ONE_STAGE_SCHEDULES)} with one stage"
        )
    if dims.pp > 1:
        fold = _check_pipeline(dh, ds, dims, batch, model_config.num_hidden_layers)
    if dh.schedule == "intra" and batch.micro_batch_size < 2:
        raise ValueError(
            f"dhelix.schedule = 'intra' splits each micro-batch in two along the batch, but "
            f"train_micro_batch_size_per_gpu is {batch.micro_batch_size}; use a micro-batch of 2 or "
            f"more samples (e.g. 2 with half the gradient_accumulation_steps), or schedule 'si'"
        )
    if dh.schedule == "auto" and batch.micro_batch_size < 2 and len(set(dh.auto_schedules) - {"intra"}) < 2:
        raise ValueError(
            f"dhelix.auto_candidates = {list(dh.auto_schedules)} with train_micro_batch_size_per_gpu "
            f"1: 'intra' needs 2 or more samples per micro-batch, which leaves one candidate; add "
            f"'sequential' or 'si', or use a micro-batch of 2"
        )
    return Setup(dh, ds, dims, batch, fold, given)


def _check_moe_kernels(ds: DeepSpeedSettings, dh: DhelixConfig, adapter, model_config) -> None:
    """``dhelix.moe.kernels`` this run cannot use (tutel missing, a model without experts, a dtype)."""
    check_kernels(
        dh.moe.kernels,
        moe=hasattr(adapter, "check_ep"),
        fp16=ds.fp16,
        device=get_accelerator().device_name(),
        hidden_size=getattr(model_config, "hidden_size", None),
    )


def _check_not_yet(ds: DeepSpeedSettings) -> None:
    """DeepSpeed features ds_dhelix does in its own way: refused, naming its key, never ignored."""
    on = ds.checkpointing_on  # an all-off section (config templates ship one) asks for nothing
    if on:
        raise ValueError(
            f'"activation_checkpointing" sets {", ".join(on)} with dhelix: DeepSpeed\'s checkpointing '
            f"wraps modules the op graph does not call; recompute inside the op graph instead: "
            f'"dhelix": {{"recompute": "full"}} (each layer keeps its input) or "selective" (attention '
            f"core and MLP activation), and drop the section"
        )


def _check_optimizer(ds: DeepSpeedSettings, dims: ParallelDims) -> None:
    """Optimizer types DeepSpeed offers that cannot run as asked with this layout or device."""
    if ds.optimizer_is("muon") and dims.tp > 1:
        raise ValueError(
            f'"optimizer": {{"type": "{ds.optimizer}"}} with tensor_parallel.size = {dims.tp}: Muon orthogonalises '
            f"each weight matrix, and a TP rank holds a slice of it (Newton-Schulz on a slice is not the slice "
            f"of the matrix's update); use tensor_parallel.size 1 (DP, EP and the pipeline keep matrices "
            f"whole), or AdamW"
        )
    if ds.optimizer_is("muon") and dims.cp > 1:
        raise ValueError(
            f'"optimizer": {{"type": "{ds.optimizer}"}} with context_parallel.size = {dims.cp} is not supported yet: '
            f"there SI's run is not bitwise that of sequential (they differ by rounding after the first Muon "
            f"step, the cause not found yet); use context_parallel.size 1 with Muon, or AdamW with CP"
        )
    if ds.optimizer_is("muon") and ds.zero.stage == 3:
        raise ValueError(
            f'"optimizer": {{"type": "{ds.optimizer}"}} with zero_optimization.stage = 3: DeepSpeed\'s Muon at '
            f"stage 3 needs each whole gradient (reduce_scatter false), and ds_dhelix's ZeRO-3 reduce-scatters "
            f"every block's gradients inside the op graph; use stage 1 or 2 (Muon gathers its matrices there)"
        )
    device = get_accelerator().device_name()
    if ds.optimizer_is("lion") and device == "cpu" and ds.zero.offload_optimizer != "cpu":
        raise ValueError(
            f'"optimizer": {{"type": "{ds.optimizer}"}} on {device}: DeepSpeed runs Lion as FusedLion, a CUDA '
            f"kernel, unless the optimizer is offloaded; set zero_optimization.offload_optimizer.device to "
            f'"cpu" (DeepSpeedCPULion, ZeRO stage 1 or more), or use AdamW'
        )


def tag_for_optimizer(model, ds: DeepSpeedSettings) -> None:
    """Muon's ``use_muon`` tags (a matrix that is neither the embedding nor the head) on the
    parameters as sharded, by DeepSpeed's own rule (``deepspeed.set_optimizer_flags``, which
    ``deepspeed.initialize`` applies to the model it is given; ds_dhelix builds the engine itself)."""
    if ds.optimizer_is("muon"):
        from types import SimpleNamespace

        from deepspeed import set_optimizer_flags

        set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=dict(ds.optimizer_params)), model)


def check_model_settings(model) -> None:
    """Settings on the model object itself that the op graph would otherwise ignore."""
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "the model's parameters are partitioned already (built inside deepspeed.zero.Init, e.g. by "
            "from_pretrained after TrainingArguments with a stage-3 config and no dhelix section): ds_dhelix "
            "shards the whole model for TP / EP and partitions it for ZeRO-3 itself; build it outside "
            "zero.Init (import ds_dhelix before building it under a dhelix config)"
        )
    if getattr(model, name, False):
        raise ValueError(
            "the model has HF gradient checkpointing enabled (gradient_checkpointing_enable()), which "
            "the ds_dhelix op graph does not call; call model.gradient_checkpointing_disable() and set "
            '"dhelix": {"recompute": "full"} (or "selective") instead'
        )


ZERO_STAGES_WITH_DHELIX = (0, 1, 2, 3)
UNSUPPORTED_KEYS = {
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence parallelism",
    "data_parallel_size": "a DeepSpeed mesh (with sequence_parallel_size)",
}


def _check_sections(ds: DeepSpeedSettings, dh, given: frozenset[str]) -> None:
    """Keys train.py and ds_dhelix cannot honour are refused (``DeepSpeedSettings`` has checked that
    the sections are JSON objects)."""
    for key, what in UNSUPPORTED_KEYS.items():
        if key in ds.keys:
            raise ValueError(f'"{key}" ({what}) is not supported with ds_dhelix / train.py; remove it')
    given = set(given) - {"enabled", "allow_unknown_deepspeed_keys"}
    if not dh.enabled and given:
        raise ValueError(
            f"dhelix.enabled is false but the section sets {sorted(given)}, which a plain DeepSpeed "
            f'run would ignore; set "enabled": true or remove them'
        )


def _check_zero(ds: DeepSpeedSettings, dh, client_optimizer: bool) -> None:
    stage = ds.zero.stage
    if dh.enabled and stage not in ZERO_STAGES_WITH_DHELIX:
        raise ValueError(
            f"zero_optimization.stage = {stage!r} with dhelix: supported stages are {list(ZERO_STAGES_WITH_DHELIX)}"
        )
    _check_grad_accum_dtype(ds)
    if dh.enabled and stage == 3:
        from .zero3 import check_zero3

        for warning in check_zero3(ds.zero, dh):
            _warn_once(warning)
    if stage >= 1 and not ds.has_optimizer and not client_optimizer:
        raise ValueError(
            f"zero_optimization.stage = {stage} partitions the optimizer state but the ds_config "
            f'has no "optimizer" section; add one (e.g. {{"type": "AdamW", "params": '
            f'{{"lr": 1e-4}}}}) or pass optimizer= to ds_dhelix.initialize'
        )


_WARNED: set = set()


def _warn_once(text: str) -> None:
    """A harmless setting's warning, once per process (rank 0)."""
    if text not in _WARNED and (not dist.is_initialized() or dist.get_rank() == 0):
        _WARNED.add(text)
        logger.warning(text)


def _check_grad_accum_dtype(ds: DeepSpeedSettings) -> None:
    """``data_types.grad_accum_dtype`` other than the training dtype: the op graph accumulates each
    micro-batch's gradient into ``.grad``, in the parameters' dtype, and DeepSpeed reduces once per
    step, so its separate accumulation never runs (at ZeRO-1 with fp16 it would see no gradient
    and train nothing, with bf16 it takes its BF16_Optimizer, at ZeRO-0 it refuses the mix).
    Refused, naming the fix."""
    if ds.grad_accum_matches:
        return
    raise ValueError(
        f"data_types.grad_accum_dtype = {ds.grad_accum_dtype!r} with {ds.half or 'fp32'} training "
        f"(zero_optimization.stage = {ds.zero.stage}): ds_dhelix accumulates each micro-batch's gradient in the parameters' dtype and DeepSpeed "
        f"reduces it once per step, so a separate accumulation dtype is not honoured; remove "
        f'"grad_accum_dtype" (fp32 training accumulates in fp32)'
    )


def _check_pipeline(dh, ds: DeepSpeedSettings, dims: ParallelDims, batch: BatchSizes, num_layers: int) -> LayerFold:
    p = dims.pp
    if dh.schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"dhelix.schedule = {dh.schedule!r} with pipeline.stages = {p}: a pipeline runs "
            f"one of {list(PIPELINE_SCHEDULES)} ('si' is the one-stage schedule)"
        )
    stage = ds.zero.stage
    if stage >= 2:
        raise ValueError(
            f"zero_optimization.stage = {stage} with pipeline.stages = {p}: ZeRO-2/3 partition "
            f"gradients, which DeepSpeed's pipeline engines cannot combine with; use stage 0 or 1"
        )
    if dims.ep > 1:
        raise ValueError(
            f"expert_parallel.size = {dims.ep} with pipeline.stages = {p} is not supported yet; "
            f"use expert_parallel.size 1 (experts replicated inside each stage)"
        )
    if dh.pair_ends:
        raise ValueError(
            f"dhelix.pair_ends = true with pipeline.stages = {p}: it pairs the first two forwards and "
            f"the last two backwards of a one-stage SI step, and a pipeline's schedule places every "
            f'pair itself; remove "pair_ends"'
        )
    if dh.planner.profile != "off":
        raise ValueError(
            f"dhelix.planner.profile = {dh.planner.profile!r} with a pipeline is not supported yet: "
            f"the pipeline uses the default SI plan; set planner.profile to 'off' (or pass plan=...)"
        )
    fold = fold_layers(num_layers, p, list(dh.pipeline.split) if dh.pipeline.split else None)
    for name in dh.auto_schedules if dh.schedule == "auto" else (dh.schedule,):
        try:
            lookup(name, PIPELINE).minimum.check(name, p, batch.gradient_accumulation_steps)
        except ValueError as err:
            if dh.schedule != "auto":
                raise
            raise ValueError(
                f"schedule 'auto' times {list(dh.auto_schedules)}: the {err}, or drop {name!r} from "
                f"dhelix.auto_candidates"
            ) from None
    return fold


def shard_model(model, dh: DhelixConfig, dims: ParallelDims, groups: ProcessGroups, lora=None):
    """Shard ``model`` in place for this rank (TP slices, this EP rank's experts) and return its op
    graph (``ModelGraph``); ``lora``: the PEFT LoRA config of a model ``unwrap_peft`` unwrapped."""
    if lora is not None:
        model.dhelix_lora = lora
    adapter = check_model(dims, model.config)
    moe = {}
    if hasattr(adapter, "check_ep"):
        ep = dh.expert_parallel
        moe = {
            "ep_groups": groups.expert_groups(),
            "capacity_factor": ep.capacity_factor,
            "aux_loss_coef": ep.aux_loss_coef,
            "kernels": dh.moe.kernels,
        }
    if dims.cp > 1:
        moe["cp"] = groups.context_shards()
    graph = adapter.build_graph(model, dims.tp, groups.tp_rank, groups.tp, groups.tp_grad_group, seed=dh.seed, **moe)
    objective = make_objective(dh.objective)
    if dh.head_chunk or objective is not None:
        graph.blocks[-1] = graph.meta["head"](chunk=dh.head_chunk, objective=objective)
    if objective is not None:  # its row sums go over the ranks of one sequence
        ranks = dims.tp * dims.cp
        graph.meta["objective"] = objective.bind(ranks, groups.sequence_group if dims.cp > 1 else groups.tp_grad_group)
    me = dims.coords(groups.rank)  # LoRA dropout: masks by data replica, the same on every TP rank
    graph.meta["needs_side"] = use_lora_dropout(model, dh.seed, me.dp_rank * dims.cp + me.cp_rank)
    whole = [p for p in lora_factors(model) if p.requires_grad]  # LoRA factors (those cut with their base skip)
    if dims.tp > 1 and whole:
        graph.replicated = ReplicatedGrads(
            list(graph.replicated.params if graph.replicated else []) + whole, groups.tp_grad_group
        )
    return fuse(graph, dh.recompute) if dh.fuse_ops else graph


def parameter_names(model, model_parameters):
    """The caller's ``model_parameters`` (a list or generator of the model's parameters, or of
    parameter groups, as given to ``deepspeed.initialize``) by name, to find them again once
    sharding has replaced them; None when not given."""
    if model_parameters is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}

    def name_of(p):
        if id(p) not in names:
            raise ValueError(
                f"model_parameters holds a tensor of shape {tuple(p.shape)} that is not a parameter of "
                f"the model given to initialize; pass that model's parameters (e.g. [p for p in "
                f"model.parameters() if p.requires_grad]) or leave model_parameters out"
            )
        return names[id(p)]

    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(group, params=[name_of(p) for p in group["params"]]) for group in items]
    return [name_of(p) for p in items]


def trained_parameters(model, named):
    """What the optimizer gets: the sharded parameters the caller named (``parameter_names``),
    or by default every parameter that requires a gradient (frozen ones, a LoRA model's base,
    get no optimizer state and no ZeRO partition)."""
    if named is None:
        return [p for p in model.parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    if named and isinstance(named[0], dict):
        return [dict(group, params=[params[n] for n in group["params"]]) for group in named]
    return [params[n] for n in named]


@dataclass(frozen=True)
class LoadReport:
    """What reading this rank's shards from a checkpoint cost (``engine.load_report``)."""

    path: str
    bytes_read: int
    peak_rss_mib: float | None  # peak resident memory while the model was built, sharded and read


def load_shards(model, weights: str | None, rank: int = 0, seed: int | None = None) -> LoadReport | None:
    """Read every parameter of ``model`` still on the meta device (this rank's shards, cut by
    ``shard_model``) from the checkpoint directory ``weights``, and draw a LoRA model's factors from
    ``seed`` (``hf_models.lora.init_meta_factors``); None when nothing is on meta."""
    from hf_models.loading import CheckpointFiles, materialize
    from hf_models.lora import init_meta_factors

    from ..runtime.memory import peak_rss_mib

    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if not on_meta:
        if weights is not None:
            raise ValueError(
                f"weights={weights!r} but the model's parameters are loaded already; build the model "
                f"with ds_dhelix.empty_model(DIR) to read only this rank's shards, or drop weights="
            )
        return None
    if weights is None:
        raise ValueError(
            f"the model's parameters are on the meta device ({on_meta[0]}, ...): pass weights=<checkpoint "
            f"directory> so each rank reads its own shards"
        )
    files = CheckpointFiles(weights)
    bar = _progress(len(on_meta), "reading shards") if rank == 0 else None
    read = materialize(model, files, progress=(lambda i, n, name: bar.update(1)) if bar is not None else None)
    init_meta_factors(model, seed or 0)
    if bar is not None:
        bar.close()
    return LoadReport(files.path, read, peak_rss_mib())


def _progress(total: int, what: str):
    from ..runtime.progress import progress

    return progress(total=total, desc=f"ds_dhelix: {what}", unit="tensor", leave=False)


def build_engine(
    model,
    config,
    *,
    args=None,
    model_parameters=None,
    optimizer=None,
    lr_scheduler=None,
    plan: SIPlan | None = None,
    example_batch: dict | None = None,
    weights: str | None = None,
):
    """The engine for ``model`` (an HF causal LM, sharded in place) under ``config`` (a ds_config
    dict or path with an enabled "dhelix" section). ``plan`` runs SI pairs by that plan, as
    ``si_execution="plan"`` would; ``example_batch`` (one micro-batch) gives the shapes to profile
    for ``planner.profile="auto"``. ``weights``: the checkpoint directory of a model built with
    ``empty_model`` (parameters on the meta device): each rank reads only its shards from it."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    if not isinstance(config, dict):
        config = load_ds_config(config)
    if not DhelixConfig.from_ds_config(config).enabled:
        raise ValueError('ds_dhelix.initialize needs "dhelix": {"enabled": true}; use deepspeed.initialize otherwise')
    # wraps an existing torch.distributed world, or starts one from the launcher's environment
    deepspeed.init_distributed(dist_init_required=not dist.is_initialized())
    release_deepspeed_shm()
    setup = check_setup(config, model.config, dist.get_world_size(), client_optimizer=optimizer is not None)
    model, lora = unwrap_peft(model)
    check_model_settings(model)
    named = parameter_names(model, model_parameters)
    _warn_ignored_by_pipeline(setup)
    groups = ProcessGroups.create(setup.dims)
    graph = model.dhelix_graph = shard_model(model, setup.dh, setup.dims, groups, lora)
    tag_for_optimizer(model, setup.ds)
    model_parameters = trained_parameters(model, named)
    ds_config = deepspeed_view(config, setup, model, len(graph.blocks))
    extra = {"args": args, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "config": ds_config}
    if setup.dims.pp > 1:
        return _pipeline_engine(model, setup, groups, graph, plan, model_parameters, extra, weights)
    report = load_shards(model, weights, groups.rank, setup.dh.seed)
    dh = setup.dh
    if plan is None and dh.schedule in ("si", "auto") and dh.si_execution == "plan":
        plan = _configured_plan(setup, graph, model, groups, example_batch)
    if graph.is_moe:  # knows expert parameters, logs aux loss and expert load
        from .moe_engine import DhelixMoeEngine as engine_class
    else:
        from .dhelix_engine import DhelixEngine as engine_class
    return engine_class(
        dhelix=dh,
        groups=groups,
        graph=graph,
        plan=plan,
        model=model,
        load_report=report,
        model_parameters=model_parameters,
        mpu=groups,
        config_class=DeepSpeedConfig(ds_config, groups),
        **extra,
    )


def default_reduce_bucket(setup: Setup, model, num_blocks: int) -> int | None:
    """With ``overlap_grad_reduction``, the ``zero_optimization.reduce_bucket_size`` for a ds_config
    that leaves it out: one layer's trained parameters on this rank (the rank's trained elements over
    the op graph's blocks), as DeepSpeed's default (5e8 elements) holds most models whole, and a
    bucket is reduced only once it is full. None: the ds_config sets it, or no overlap."""
    if not setup.dh.overlap_grad_reduction or setup.ds.zero.reduce_bucket_size is not None:
        return None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(1, -(-trained // max(num_blocks, 1)))


def deepspeed_view(config: dict, setup: Setup, model=None, num_blocks: int = 1) -> dict:
    """The ds_config DeepSpeed reads: without the dhelix section; with context parallelism the batch
    is counted over DeepSpeed's data-parallel group, DP x CP (CP ranks share each sample); one
    stage of ``model`` (``num_blocks`` op-graph blocks): ``default_reduce_bucket``."""
    ds_config = copy.deepcopy(config)
    ds_config.pop("dhelix", None)
    bucket = default_reduce_bucket(setup, model, num_blocks) if model is not None and setup.dims.pp == 1 else None
    if bucket is not None:
        ds_config["zero_optimization"] = {**(ds_config.get("zero_optimization") or {}), "reduce_bucket_size": bucket}
    if setup.dims.cp > 1:
        b = setup.batch
        ds_config.update(
            {
                "train_batch_size": b.train_batch_size * setup.dims.cp,
                "train_micro_batch_size_per_gpu": b.micro_batch_size,
                "gradient_accumulation_steps": b.gradient_accumulation_steps,
            }
        )
    return ds_config


def initialize(
    args=None,
    model=None,
    config=None,
    model_parameters=None,
    optimizer=None,
    lr_scheduler=None,
    plan: SIPlan | None = None,
    example_batch: dict | None = None,
    weights: str | None = None,
):
    """Like ``deepspeed.initialize`` for an HF causal LM: returns ``(engine, optimizer, None,
    lr_scheduler)`` (see :func:`build_engine`)."""
    engine = build_engine(
        model,
        config,
        args=args,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        plan=plan,
        example_batch=example_batch,
        weights=weights,
    )
    return engine, engine.optimizer, None, engine.lr_scheduler


def _warn_ignored_by_pipeline(setup: Setup) -> None:
    """The pipeline runs every pair by its plan (the default plan): keys of reactive execution are
    harmless there but do nothing; say so once."""
    dh = setup.dh
    given = [k for k in ("si_execution", "defer_weight_grads", "react_to_completions") if k in setup.given]
    given += ["overlap_grad_reduction"] if "overlap_grad_reduction" in setup.given and dh.overlap_grad_reduction else []
    if setup.dims.pp > 1 and given and dist.get_rank() == 0:
        logger.warning(
            f"ds_dhelix: dhelix.{' and dhelix.'.join(given)} have no effect with a pipeline: every "
            f"forward/backward pair runs by the SI plan's rounds (the default plan), and the data-parallel "
            f"reduction runs after the last backward"
        )
    if (
        "react_to_completions" in setup.given
        and dh.react_to_completions
        and get_accelerator().device_name() == "cuda"
        and dist.get_rank() == 0
    ):
        logger.warning(
            "ds_dhelix: dhelix.react_to_completions = true has no effect on CUDA: the host does not wait on "
            "the device to see a collective complete, and every rank launches in the same order (the order "
            "'false' names); it is honoured on CPU (gloo)"
        )


def _pipeline_engine(
    model, setup: Setup, groups: ProcessGroups, graph, plan, model_parameters, extra: dict, weights: str | None
):
    """Fold and prune ``model`` for this rank's stage; the folded pipeline engine."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ..pipe.engine import FoldedPipelineEngine
    from ..pipe.module import FoldedPipelineModule

    if groups.rank == 0:
        logger.info(
            f"ds_dhelix: folded pipeline, schedule {setup.dh.schedule!r}, {setup.dims.describe()}; "
            f"layer -> (rank, phase):\n{setup.fold.table()}"
        )
    if plan is None:
        specs = graph.layer_specs()
        plan = default_plan(specs, backward_order(specs))
    loaded = []  # this stage's shards are read once the other stages' layers are pruned
    module = FoldedPipelineModule(
        model,
        graph,
        setup.fold,
        groups.topology,
        on_pruned=lambda pruned: loaded.append(load_shards(pruned, weights, groups.rank, setup.dh.seed)),
    )
    mpu = module.mpu()
    kept = {id(p) for p in module.parameters()}  # the caller's list may name pruned parameters
    if model_parameters and isinstance(model_parameters[0], dict):
        params = [dict(g, params=[p for p in g["params"] if id(p) in kept]) for g in model_parameters]
    else:
        params = [p for p in model_parameters if id(p) in kept]
    return FoldedPipelineEngine(
        dhelix=setup.dh,
        groups=groups,
        plan=plan,
        model=module,
        model_parameters=params,
        load_report=loaded[0],
        mpu=mpu,
        config_class=DeepSpeedConfig(extra["config"], mpu),
        **extra,
    )


def _on_run_device(model, example_batch: dict | None, ds: DeepSpeedSettings, log) -> dict | None:
    """The model moved to the device DeepSpeed's engine will put it on (it moves it there anyway),
    and the profiling micro-batch with it, so the planner times the run's device; a model that
    DeepSpeed will cast to bf16 / fp16 after is timed in its own dtype (said once)."""
    import torch

    device = torch.device(get_accelerator().current_device_name())
    model.to(device)
    dtype = next(model.parameters()).dtype
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ds.half)
    if cast is not None and dtype != cast:
        log(
            f"ds_dhelix: the planner times the model in {dtype} before DeepSpeed casts it to {cast}; build "
            f"it in {cast} (torch_dtype=) for a table of the kernels the run uses"
        )
    if example_batch is None:
        return None
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example_batch.items()}


def _configured_plan(setup: Setup, graph, model, groups: ProcessGroups, example_batch) -> SIPlan:
    """The searched plan when ``planner.profile`` asks for one, else the default plan."""
    from ..planning.planner import predict_ms
    from ..runtime.profiler import resolve_plan, run_meta

    specs = graph.layer_specs()
    fallback = default_plan(specs, backward_order(specs))
    dh = setup.dh
    if dh.planner.profile == "off":
        return fallback
    micro = setup.ds.micro_batch_size
    shape = tuple(example_batch["input_ids"].shape) if example_batch is not None else (micro, None)
    dtype = next(model.parameters()).dtype
    meta = run_meta(
        model.config,
        groups.tp_size,
        groups.world_size,
        shape,
        dtype,
        dh.benchmark.link_gbps,
        ep=groups.ep_size,
        cp=groups.cp_size,
        cp_comm=groups.dims.cp_comm,
        fused=dh.fuse_ops,
    )
    log = (lambda msg: logger.info(msg)) if groups.rank == 0 else (lambda msg: None)
    example_batch = _on_run_device(model, example_batch, setup.ds, log)
    plan, table = resolve_plan(dh.planner, graph, meta, example_batch, list(model.parameters()), log)
    fused = " over fused runs (fuse_ops: false lets the planner cut a run)" if dh.fuse_ops else ""
    log(
        f"ds_dhelix: SI plan '{plan.source}'{fused} (predicted {predict_ms(table, plan):.2f} ms per layer pair; "
        f"default plan {predict_ms(table, fallback):.2f} ms)\n{plan.render_text()}"
    )
    return plan
