"""The folded pipeline as data: the layer fold (``folding``), every rank's instruction list
(``schedule``) and the replay simulator that checks them (``simulate``). Plain data: imports
nothing else of ds_dhelix, never torch.distributed. The engine that runs these lists is
``ds_dhelix.engine.pipe_engine``, the folded module ``ds_dhelix.engine.pipe_module``.
"""
