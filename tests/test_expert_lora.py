"""LoRA on MoE experts (PEFT ``target_parameters`` on the fused expert tensors, ``hf_models/expert_lora.py``).

EP=2             tiny-mixtral, tiny-qwen3-moe, tiny-deepseek-v3 (and gpt-oss's transposed tensors),
                 each EP rank holding its experts' factors: SI = sequential bitwise over two engine
                 steps; the sharded first step equals the unsharded PEFT model's (loss, every
                 adapter gradient in PEFT's layout, 1e-5)
exports          the adapter written by ``export_adapter`` loads with ``PeftModel.from_pretrained``
                 and reproduces the trained model's loss; ``merge_and_unload`` of it equals the
                 engine's merged HF export bit for bit
refusals         LoRA on a router, on a model built on the meta device
"""

from __future__ import annotations

import pytest
import torch

from ds_dhelix.runtime.spawn import run_ranks

LORA = {
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj"],
    "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
}
MODELS = ("tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss")


def _opts(model: str):
    from ds_dhelix.verify import ParityOptions

    opts = ParityOptions(model=model, tp=1, dp=2, steps=2, seq_len=16, num_layers=2, micro_batches=2, lora=LORA)
    opts.extra = {"expert_parallel": {"size": 2, "capacity_factor": None}}
    return opts


def _train(opts, schedule: str, out_dir=None):
    import ds_dhelix
    from ds_dhelix.verify import build, make_batches
    from ds_dhelix.verify.options import my_share

    engine, *_ = ds_dhelix.initialize(model=build(opts), config=opts.ds_config(schedule))
    losses = []
    steps = make_batches(opts, 512)
    for step in steps:
        losses.append(float(engine.train_batch(iter(my_share(opts, step, engine.groups.dp_rank)))))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    exported = None
    if out_dir is not None:
        probe = float(engine.eval_batch(iter(steps[0][: opts.micro_batches])))
        engine.export_adapter(f"{out_dir}/adapter")
        engine.export_hf(f"{out_dir}/merged")
        exported = probe
    engine.destroy()
    return losses, params, exported


def peft_first_step(opts, steps):
    """The unsharded PEFT model's first step: mean loss and adapter gradients by PEFT key."""
    from peft import get_peft_model_state_dict

    from ds_dhelix.verify.options import build

    model = build(opts, stochastic=False)
    model.train()
    total = 0.0
    for b in steps[0]:
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(steps[0])
        loss.backward()
        total += loss.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    keys = get_peft_model_state_dict(model)  # (PEFT's file keys: the parameter names without ".default")
    named = {k: grads[k.replace(".weight", ".default.weight")] for k in keys}
    return total, named


def _world(rank, world, out_dir):
    from ds_dhelix.verify.batches import make_batches
    from ds_dhelix.verify.legs import first_step

    out = {}
    for model in MODELS:
        opts = _opts(model)
        seq, si = _train(opts, "sequential"), _train(opts, "si", f"{out_dir}/{model}")
        ours = first_step(opts, make_batches(opts, 512))
        peft = peft_first_step(opts, make_batches(opts, 512)) if rank == 0 else None
        out[model] = (seq, si, ours, peft)
    return out


@pytest.mark.timeout(900)
def test_expert_lora_ep2(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ds_dhelix.verify.batches import make_batches
    from hf_models.lora import LoraInfo, adapter_file_tensor

    results = run_ranks(_world, 2, args=(str(tmp_path),), timeout=880)
    for rank, out in enumerate(results):
        for model, ((losses, params, _), (si_losses, si_params, _), _, _) in out.items():
            assert losses == si_losses, (model, rank, losses, si_losses)
            for n in params:
                assert torch.equal(params[n], si_params[n]), (model, rank, n)
            assert any(n.endswith("gate_up_proj_lora_A") for n in params), model
    for model, (_, (_, _, probe), ours, (loss, grads)) in results[0].items():
        assert abs(ours["loss"] - loss) < 1e-5, (model, ours["loss"], loss)
        info = LoraInfo(None, {}, frozenset(), {}, _expert_specs(model))
        mine = dict(
            adapter_file_tensor(n, g, info) for n, g in ours["grads"].items() if n.endswith(("_lora_A", "_lora_B"))
        )
        mine.update(
            {f"base_model.model.{n}.weight": g for n, g in ours["grads"].items() if n.endswith((".lora_A", ".lora_B"))}
        )
        assert mine.keys() == grads.keys(), (model, sorted(set(mine) ^ set(grads))[:4])
        for k, g in grads.items():
            assert (mine[k] - g).abs().max() < 1e-5, (model, k)
        opts = _opts(model)
        peft = PeftModel.from_pretrained(_base(opts), str(tmp_path / model / "adapter")).eval()
        with torch.no_grad():
            batches = make_batches(opts, 512)[0][: opts.micro_batches]
            again = sum(float(peft(input_ids=b["input_ids"], labels=b["labels"]).loss) for b in batches) / len(batches)
        assert abs(again - probe) < 1e-5, (model, again, probe)  # the adapter file holds the trained factors
        merged = peft.merge_and_unload().state_dict()
        ours_merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / model / "merged")).state_dict()
        assert merged.keys() == ours_merged.keys(), model
        for k, v in merged.items():
            assert torch.equal(ours_merged[k], v), (model, k)  # both fold the update in fp32


def _base(opts):
    from hf_models.registry import build_model

    return build_model(opts.model, seed=opts.seed, num_layers=opts.num_layers)[0]


def _expert_specs(model: str):
    """The expert adapters' layout (PEFT's keys, ranks, experts) of the tests' LoRA on ``model``."""
    from ds_dhelix.verify.options import with_lora
    from hf_models.expert_lora import take_wrappers

    return take_wrappers(with_lora(_base(_opts(model)), LORA, 0).base_model.model, "default")


def test_lora_on_a_router_is_refused_in_one_line():
    from peft import LoraConfig, get_peft_model

    from hf_models.adapters import unwrap_peft
    from hf_models.registry import build_model

    model = get_peft_model(
        build_model("tiny-qwen3-moe", seed=0, num_layers=1)[0],
        LoraConfig(r=2, target_modules=[], target_parameters=["mlp.gate.weight"]),
    )
    with pytest.raises(ValueError) as err:
        unwrap_peft(model)
    assert "mlp.gate.weight" in str(err.value) and "routers" in str(err.value) and "\n" not in str(err.value)
