"""ds_dhelix: DHelix strand interleaving for DeepSpeed.

``ds_dhelix.initialize(...)`` mirrors ``deepspeed.initialize``; importing the package itself stays
light (the planner, plans and schedules never import deepspeed or torch.distributed).
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("initialize", "DhelixEngine"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
