"""The old import path of ``DhelixTrainer`` (``from ds_dhelix.trainer import DhelixTrainer``): it
lives in :mod:`ds_dhelix.engine.trainer`; ``ds_dhelix.DhelixTrainer`` is the same class."""

from .engine.trainer import REFUSED_ARGS, SCHEDULE_STEP_KEYS, DhelixTrainer

__all__ = ["DhelixTrainer", "REFUSED_ARGS", "SCHEDULE_STEP_KEYS"]
