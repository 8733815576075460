"""DeepSpeed engines and everything around a run: the one build path (``build``), the engines
(``dhelix_engine``; ``moe_engine``; the folded pipeline's is ``ds_dhelix.pipe.engine``), what
both do around a step (``stepping``), HF export and checkpoints (``checkpoint``, ``resume``),
clean stops (``stopping``), the guard on plain DeepSpeed engines (``guard``), mixed precision
(``precision``), ``DhelixTrainer`` (``trainer``), the target-weighted evaluation loss it shares
with train.py (``evaluation``) and the parity check (``parity``). May import ``hf_models`` and
every layer below it; the training loop (``ds_dhelix.training``), the commands and benchmarks sit
above.

This ``__init__`` imports nothing (``ds_dhelix`` imports ``engine.guard`` at start).
"""
