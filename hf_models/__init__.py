"""Hugging Face models as op graphs: family adapters (``dense_family`` and ``moe_family`` with one
spec per family, ``gpt2``, ``gpt_neox``), the shared layer machinery (``common``, ``ring``), sharded
loading (``loading``), the model registry and the tiny presets. Sits between ``ds_dhelix.moe`` (and
the layers below it) and ``ds_dhelix.engine``: it may import ``ds_dhelix.moe``, ``runtime``,
``planning``, ``pipe``, ``config``, ``graph`` and ``data``, never the engine.
"""
