"""Step-time projection (``dhelix predict``): per-op costs from a roofline model of the hardware
(``roofline``, ``hardware``, ``links``) or from a profiled overlap table (``cpu``), then the
executor's order (``retime``), the planner and the pipeline replay the engine would use (``step``,
``pipeline``), for sequential, SI, intra and the folded pipeline schedules (``report``).

Plain data: may import ``planning``, ``pipe``, ``config`` and ``graph``; never torch,
torch.distributed or deepspeed (it runs without processes; the model's op lists and shapes come
in as data).
"""
