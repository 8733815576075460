"""The folded pipeline, in one room (as DeepSpeed keeps its own in ``deepspeed/runtime/pipe/``).

    folding.py   the layer fold: 2p chunks folded into a U over p ranks, layer -> (rank, phase)
    schedule.py  the W, DualPipeV+SI and sequential-fold schedules: every rank's instruction list
    module.py    FoldedPipelineModule: one rank's two chunks of an HF model as a DeepSpeed PipelineModule
    engine.py    FoldedPipelineEngine: DeepSpeed's PipelineEngine running those lists through the SI executor

The room is layered inside, engine > module > schedule > folding, and spans two floors of the
package's layers: ``folding`` and ``schedule`` are plain data (no torch, no DeepSpeed) on the
schedule floor, read by ``dhelix predict``, ``dhelix simulate``, the schedule registry and the
engine's checks; ``module`` and ``engine`` sit on the engine floor beside ``ds_dhelix.engine``
(the engine subclasses its step mixin; the one build path constructs it). This ``__init__``
imports nothing, so reading the fold never loads torch.
"""
