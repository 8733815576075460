"""What the user asked for, checked: the ``"dhelix"`` section of a ds_config (``section``), the
top-level DeepSpeed keys it may sit beside (``ds_keys``) and the parallel layout (``dims``).
Plain data: imports only ``ds_dhelix.graph`` (the recompute modes); never torch.distributed.

``from ds_dhelix.config import DhelixConfig`` keeps working: the section's names are re-exported.
"""

from .section import (
    AUTO_CANDIDATES,
    CP_COMMS,
    MOE_KERNELS,
    ONE_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    RECOMPUTE_MODES,
    SCHEDULES,
    SECTION,
    SI_EXECUTIONS,
    BatchSizes,
    BenchmarkConfig,
    ContextParallelConfig,
    DhelixConfig,
    ExpertParallelConfig,
    MoeConfig,
    ObjectiveConfig,
    PipelineConfig,
    PlannerConfig,
    TensorParallelConfig,
    TraceConfig,
    derive_batch,
    load_ds_config,
)

__all__ = [
    "AUTO_CANDIDATES",
    "CP_COMMS",
    "MOE_KERNELS",
    "ONE_STAGE_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "SECTION",
    "SI_EXECUTIONS",
    "BatchSizes",
    "BenchmarkConfig",
    "ContextParallelConfig",
    "DhelixConfig",
    "ExpertParallelConfig",
    "ObjectiveConfig",
    "MoeConfig",
    "PipelineConfig",
    "PlannerConfig",
    "TensorParallelConfig",
    "TraceConfig",
    "derive_batch",
    "load_ds_config",
]
