"""HF MoE checkpoint (every family) -> EP=2 training, each rank reading only its experts
(``ds_dhelix.empty_model`` + ``weights=``) -> streamed HF checkpoint: plain transformers and an EP=1
run both reproduce the trained model's loss."""
import pytest
import torch

from ds_dhelix.spawn import run_ranks


def _cfg(ep):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1},
           "dhelix": {"enabled": True, "schedule": "si"}}
    if ep > 1:
        cfg["dhelix"]["expert_parallel"] = {"size": ep}
    return cfg


def _batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 2048, (2, 32), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _train_and_export(rank, world, src, dst):
    import ds_dhelix
    model = ds_dhelix.empty_model(src)
    engine, *_ = ds_dhelix.initialize(model=model, config=_cfg(2), weights=src)
    assert engine.load_report is not None and engine.load_report.bytes_read > 0
    data = _batches(rank, 4)
    engine.train_batch(iter(data[:2]))
    engine.train_batch(iter(data[2:]))
    probe = _batches(99, 1) * 2
    loss = float(engine.eval_batch(iter(probe)))
    engine.export_hf(dst)
    return loss


def _eval_ep1(rank, world, src):
    import ds_dhelix
    from hf_models.registry import build_model
    model, _ = build_model(src, seed=0)
    engine, *_ = ds_dhelix.initialize(model=model, config=_cfg(1))
    return float(engine.eval_batch(iter(_batches(99, 1) * 2)))


@pytest.mark.parametrize("preset", ["tiny-phimoe", "tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-olmoe"])
def test_hf_to_ep2_to_hf_and_ep1(tmp_path, preset):
    from transformers import AutoModelForCausalLM
    from hf_models.registry import build_model
    model, _ = build_model(preset, seed=3)
    model.save_pretrained(tmp_path / "in")
    trained = run_ranks(_train_and_export, 2, args=(str(tmp_path / "in"), str(tmp_path / "out")), timeout=240)
    assert trained[0] == trained[1]  # the loss is averaged over both data-parallel ranks
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    hf.eval()
    probe = _batches(99, 1)[0]
    with torch.no_grad():
        hf_loss = hf(**probe).loss.item()
    # fp32; the sharded run sums in another order (sequence-first tokens, per-expert batches)
    assert abs(hf_loss - trained[0]) < 1e-5, (hf_loss, trained[0])
    ep1 = run_ranks(_eval_ep1, 2, args=(str(tmp_path / "out"),), timeout=240)
    assert abs(ep1[0] - trained[0]) < 1e-5, (ep1[0], trained[0])
