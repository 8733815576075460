"""Plain DeepSpeed's optimizer step (the ds_config's dhelix section off), as the loop runs it."""

from __future__ import annotations


def plain_step(engine, batches):
    """One optimizer step of plain DeepSpeed: forward/backward per micro-batch, then step; the
    step's loss averaged over the micro-batches and the world (``Train/loss`` in TensorBoard)."""
    import torch
    import torch.distributed as dist

    from ds_dhelix.engine.evaluation import plain_inputs

    total = 0.0
    gas = engine.gradient_accumulation_steps()
    for _ in range(gas):
        out = engine(**plain_inputs(engine, next(batches)))
        engine.backward(out.loss)
        engine.step()
        total += out.loss.detach().float()
    loss = torch.as_tensor(total / gas)
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    if engine.monitor.enabled and engine.global_rank == 0:
        engine.monitor.write_events([("Train/loss", float(loss), engine.global_steps)])
    return loss
