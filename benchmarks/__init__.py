"""Research harness around ``dhelix bench`` and ``dhelix trace`` (not part of what a training run
needs): DeepSpeed's own pipelines as baselines (``ds_pipelines``), the re-timing of traced SI pairs
on an idealised machine (``pair_retime``), where a trace's compute lane waited
(``trace_analysis``), and a link micro-benchmark (``allreduce_link``). Results and their analysis
live in ``benchmarks/results/``."""
