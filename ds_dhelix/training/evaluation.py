"""Evaluation of a run's held-out blocks: every data-parallel replica its share, in micro-batches
of the training's size, through the target-weighted loss that ``DhelixTrainer.evaluate`` reports
too (``ds_dhelix.engine.evaluation.evaluate_loss``); the result goes to TensorBoard as ``Eval/loss``.
"""

from __future__ import annotations


def eval_microbatches(blocks, micro: int, dp_rank: int, dp_size: int) -> tuple[list[dict], list[int]]:
    """This replica's micro-batches of ``blocks`` (a ``BlockDataset``) and their target counts.
    Replica r takes blocks r, r + dp, r + 2 dp, ...; every replica gets the same number of
    micro-batches (so the same forwards): a short one is filled up with block 0 whose targets are
    all ignored, and a micro-batch of filling only keeps its targets but is weighed 0."""
    import torch

    from ds_dhelix.data import valid_targets

    per_rank = -(-len(blocks) // dp_size)
    count = -(-per_rank // micro)
    mine = list(range(dp_rank, len(blocks), dp_size))
    batches, weights = [], []
    for k in range(count):
        real = mine[k * micro : (k + 1) * micro]
        rows = blocks.rows(torch.tensor(real + [0] * (micro - len(real))))
        if real and len(real) < micro:
            rows["labels"][len(real) :] = -100
        weights.append(valid_targets(rows["labels"]) if real else 0)
        batches.append(rows)
    return batches, weights


def evaluate(engine, blocks, micro: int | None = None, prog: str = "ds_dhelix") -> dict:
    """``{"step", "loss"}``: the target-weighted loss over every block of ``blocks`` at the
    engine's current step, forward only (``micro``: blocks per micro-batch, default the engine's
    ``train_micro_batch_size_per_gpu``). Rank 0 writes ``Eval/loss`` to the engine's TensorBoard
    and says it (``prog``: the message's prefix). Collective."""
    import torch.distributed as dist

    from ds_dhelix.engine.evaluation import data_parallel, evaluate_loss

    micro = micro or engine.train_micro_batch_size_per_gpu()
    dp_rank, dp_size, _ = data_parallel(engine)
    batches, weights = eval_microbatches(blocks, micro, dp_rank, dp_size)
    loss, targets = evaluate_loss(engine, batches, weights)
    step = engine.global_steps
    if engine.monitor.enabled and dist.get_rank() == 0:
        engine.monitor.write_events([("Eval/loss", loss, step)])
    if dist.get_rank() == 0:
        print(f"{prog}: step {step}: eval loss {loss:.4f} over {targets} target tokens", flush=True)
    return {"step": step, "loss": loss}
