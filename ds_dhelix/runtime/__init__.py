"""What runs on a rank: the executor (the only place that knows streams and async handles), the
communication ops and process groups (``comm``, ``groups``), the profiler that measures overlap
tables with the executor (``profiler``), the watchdog, link emulation, the trace recorder, the
activation-memory meter and the spawner of CPU worlds. May import ``planning``, ``pipe``,
``config``, ``graph`` and ``data``; never the engine, hf_models or moe.
"""
