"""Multi-process test helper: see ``ds_dhelix.spawn.run_ranks``."""
from ds_dhelix.spawn import free_port, run_ranks  # noqa: F401
