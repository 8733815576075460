"""SI plans and how they are chosen: plans (``plan``: rounds pairing forward and backward
segments), overlap tables and the DP planner (``planner``), their JSON files (``jsonfile``) and
the ``"schedule": "auto"`` chooser (``autoschedule``). Plain data: imports only
``ds_dhelix.graph``; never torch.distributed (the profiler that fills tables is in ``runtime``).
"""
