"""HF MoE checkpoint (every family, DeepSeek-V3's and GLM-4.5's router biases included) -> EP=2 training, each rank reading only its experts
(``ds_dhelix.empty_model`` + ``weights=``) -> streamed HF checkpoint: plain transformers and an EP=1
run both reproduce the trained model's loss."""

import torch

from ds_dhelix.runtime.spawn import run_ranks


def _cfg(ep):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "dhelix": {"enabled": True, "schedule": "si"},
    }
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


PRESETS = [
    "tiny-phimoe",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-olmoe",
    "tiny-deepseek-v3",
    "tiny-glm4-moe",
    "tiny-gpt-oss",
    "tiny-qwen3-moe-mixed",
    "tiny-qwen3-5-moe",
]


def _biases(model) -> dict:
    """The routers' ``e_score_correction_bias`` buffers (DeepSeek-V3, GLM-4.5) by name."""
    return {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def _train_and_export(src, dst, rank):
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


def _eval_ep1(src):
    import ds_dhelix
    from hf_models.registry import build_model

    model, _ = build_model(src, seed=0)
    engine, *_ = ds_dhelix.initialize(model=model, config=_cfg(1))
    return float(engine.eval_batch(iter(_batches(99, 1) * 2)))


def _every_family(rank, world, root):
    """One 2-rank world for all families (one world start instead of ten): each family trained at
    EP=2 from its HF checkpoint and exported, then its export evaluated at EP=1."""
    out = {}
    for preset in PRESETS:
        trained = _train_and_export(f"{root}/{preset}/in", f"{root}/{preset}/out", rank)
        torch.distributed.barrier()  # rank 0 has written the export every rank reads next
        out[preset] = (trained, _eval_ep1(f"{root}/{preset}/out"))
    return out


def test_hf_to_ep2_to_hf_and_ep1(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_models.registry import build_model

    g = torch.Generator().manual_seed(5)
    sources = {}
    for preset in PRESETS:
        model, _ = build_model(preset, seed=3)
        for b in _biases(model).values():  # not HF's zeros: the loading must read them, the export write them
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
        sources[preset] = _biases(model)
        model.save_pretrained(tmp_path / preset / "in")
    ranks = run_ranks(_every_family, 2, args=(str(tmp_path),), timeout=600)
    probe = _batches(99, 1)[0]
    for preset in PRESETS:
        (trained, ep1), (other, _) = ranks[0][preset], ranks[1][preset]
        assert trained == other, preset  # the loss is averaged over both data-parallel ranks
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / preset / "out")
        hf.eval()
        exported = _biases(hf)
        assert exported.keys() == sources[preset].keys(), preset
        for name, bias in exported.items():  # fp32, never trained (HF does not update it)
            assert bias.dtype == torch.float32 and torch.equal(bias, sources[preset][name]), (preset, name)
        with torch.no_grad():
            hf_loss = hf(**probe).loss.item()
        # fp32; the sharded run sums in another order (sequence-first tokens, per-expert batches)
        assert abs(hf_loss - trained) < 1e-5, (preset, hf_loss, trained)
        assert abs(ep1 - trained) < 1e-5, (preset, ep1, trained)
