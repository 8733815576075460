"""DeepSpeed checkpoints of a DhelixEngine (TP=2, ZeRO-1): save, load into a fresh engine, and
the next step is bitwise the same as without the interruption."""

import torch

from ds_dhelix.runtime.spawn import run_ranks


def _rank(rank, world, ckpt_dir):
    import ds_dhelix
    from ds_dhelix.verify import ParityOptions, build, make_batches

    opts = ParityOptions(model="tiny-llama", tp=2, steps=3, micro_batches=2, seq_len=32, num_layers=2)
    batches = make_batches(opts, 2048)

    def engine_for(seed):
        opts.seed = seed
        engine, *_ = ds_dhelix.initialize(model=build(opts), config=opts.ds_config("si"))
        return engine

    a = engine_for(1234)
    for step in batches[:2]:
        a.train_batch(iter(step))
    a.save_checkpoint(ckpt_dir, tag="step2")
    loss_a = a.train_batch(iter(batches[2]))
    b = engine_for(999)  # other random init: everything must come from the checkpoint
    b.load_checkpoint(ckpt_dir, tag="step2")
    loss_b = b.train_batch(iter(batches[2]))
    same = all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
    return float(loss_a), float(loss_b), same, b.global_steps


def test_save_load_resume_is_exact(tmp_path):
    for loss_a, loss_b, same, steps in run_ranks(_rank, 2, args=(str(tmp_path / "ckpt"),), timeout=240):
        assert loss_a == loss_b
        assert same
        assert steps == 3
