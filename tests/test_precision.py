"""fp16 and bf16 under SI, through the DeepSpeed engine on 2 gloo ranks (tiny-llama TP=2, 2 layers).

    fp16 (DeepSpeed's dynamic loss scaler) and bf16: SI bitwise equal to sequential
    fp16's first-step unscaled grad norm matches fp32's; 20 fp16 steps track the fp32 losses
    an inf in one rank's gradient: the step is skipped on every rank, the scale halves, the
    parameters stay as they were; the next step trains again
    fp16 on a device without it: one line before any model is built
    dropout 0.1 (GPT-2, Llama): SI bitwise equal to sequential, HF compared with dropout off; masks
    drawn by micro-batch number (a fresh process draws what an uninterrupted one did); eval none

fp16 runs on this CPU through DeepSpeed's CPU accelerator (``force_fp16_capability`` where it
would refuse; torch computes fp16 on CPU).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ds_dhelix.verify import ParityOptions, make_batches, run_parity
from tests.conftest import run_ranks

# fp16 keeps 11 significant bits: every activation and gradient is rounded at ~5e-4 relative. The
# grad norm sums ~1e5 squared entries whose rounding errors are independent, so it moves far
# less; the losses drift as the rounded updates accumulate. Measured on this machine (the runs
# are deterministic): norm ratio 1 - 7e-6, losses within 2.1e-4 over 20 steps. A missing loss
# scale moves the norm by a factor 65536 (the initial scale); these bounds leave 100x and 20x.
NORM_RTOL = 1e-3
LOSS_ATOL = 5e-3


def _opts(**kw) -> ParityOptions:
    return ParityOptions(model="tiny-llama", tp=2, num_layers=2, seq_len=32, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_si_bitwise_equals_sequential_in_half_precision(dtype):
    r = run_parity(_opts(dtype=dtype), timeout=280)
    assert r["bitwise_equal"] and r["losses"]["si"] == r["losses"]["sequential"], r
    assert r["ok"] and r["hf_close"] is None  # the HF reference is fp32 only
    assert all(1.0 < x < 20.0 for x in r["losses"]["si"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_w_pipeline_bitwise_equals_sequential_in_half_precision(dtype):
    """A stage without the embedding makes its rotary tables in the stage's dtype (DeepSpeed casts
    parameters only, not the dropped ones' stand-ins): a q/k-norm family's attention saw fp32
    queries against bf16 values before."""
    opts = ParityOptions(model="tiny-qwen3-moe", tp=1, pp=2, schedule="w", num_layers=4, seq_len=32, steps=1)
    r = run_parity(replace(opts, dtype=dtype), timeout=280)
    assert r["ok"] and r["bitwise_equal"], r


def _train_dtypes(rank, world, steps):
    from ds_dhelix.engine.build import build_engine
    from ds_dhelix.engine.precision import force_fp16_capability
    from ds_dhelix.verify import build

    force_fp16_capability()
    out = {}
    for dtype in ("fp32", "fp16"):
        opts = _opts(dtype=dtype, steps=steps)
        batches = make_batches(opts, 2048)
        engine = build_engine(build(opts), opts.ds_config("si"))
        losses, norms, scales = [], [], []
        for step in batches:
            losses.append(float(engine.train_batch(iter(step))))
            norms.append(float(engine.get_global_grad_norm()))
            scales.append(engine._get_optimizer_loss_scale() if dtype == "fp16" else None)
        engine.destroy()
        out[dtype] = {"losses": losses, "norms": norms, "scales": scales}
    return out


@pytest.mark.timeout(400)
def test_fp16_tracks_fp32():
    r = run_ranks(_train_dtypes, 2, args=(20,), timeout=380)[0]
    n32, n16 = r["fp32"]["norms"][0], r["fp16"]["norms"][0]
    assert abs(n16 / n32 - 1) < NORM_RTOL, (n16, n32)  # the unscaled norm, not scale x norm
    diffs = [abs(a - b) for a, b in zip(r["fp16"]["losses"], r["fp32"]["losses"])]
    assert max(diffs) < LOSS_ATOL, diffs
    assert r["fp16"]["scales"][0] == 2**16  # no overflow in these steps: the initial scale stays


def _overflow_rank(rank, world):
    from ds_dhelix.engine.build import build_engine
    from ds_dhelix.engine.checkpoint import full_state_dict
    from ds_dhelix.engine.precision import force_fp16_capability
    from ds_dhelix.verify import build

    force_fp16_capability()
    opts = _opts(dtype="fp16", steps=3)
    batches = make_batches(opts, 2048)
    config = opts.ds_config("si")
    config["fp16"]["hysteresis"] = 1  # lower the scale at the first overflow (DeepSpeed's default waits for 2)
    engine = build_engine(build(opts), config)
    target = next(p for p in engine.module.parameters() if p.requires_grad)

    def poison(grad):  # one gradient entry becomes inf as it reaches the parameter
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    seen = []
    for k, step in enumerate(batches):
        hook = target.register_hook(poison) if k == 1 and rank == 1 else None  # step 2, rank 1 only
        engine.train_batch(iter(step))
        if hook is not None:
            hook.remove()
        params = {n: t.clone() for n, t in full_state_dict(engine.module, engine.groups.tp_grad_group, 2).items()}
        seen.append({"scale": engine._get_optimizer_loss_scale(), "skipped": engine.skipped_steps, "params": params})
    engine.destroy()
    same = [all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]) for a, b in zip(seen, seen[1:])]
    return {"scales": [s["scale"] for s in seen], "skipped": [s["skipped"] for s in seen], "unchanged": same}


@pytest.mark.timeout(300)
def test_overflow_on_one_rank_skips_the_step_on_every_rank():
    for r in run_ranks(_overflow_rank, 2, timeout=280):
        assert r["scales"] == [2**16, 2**15, 2**15], r["scales"]  # halved once, on both ranks
        assert r["skipped"] == [0, 1, 1]
        assert r["unchanged"] == [True, False]  # step 2 skipped (params kept), step 3 trained


def test_fp16_on_a_device_without_it_is_one_line(monkeypatch, capsys, tmp_path):
    import json
    import os

    from deepspeed.accelerator import get_accelerator

    import train

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "ds_configs", "tiny_llama_cpu.json")))
    cfg["fp16"] = {"enabled": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert train.main(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("train.py: error:") == 1 and "fp16 is not supported on this device" in err and "bf16" in err


def test_parity_command_runs_fp16_on_a_device_without_it(monkeypatch):
    """``dhelix parity --dtype fp16`` (documented as forced on such a CPU) passes its pre-checks,
    as its ranks do, instead of refusing what the ranks would run."""
    from deepspeed.accelerator import get_accelerator

    from ds_dhelix.verify import ParityOptions
    from ds_dhelix.verify.options import check_options  # what dhelix parity runs before its ranks

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    check_options(ParityOptions(model="tiny-llama", tp=2, dtype="fp16"))
    assert get_accelerator().is_fp16_supported()


# ------------------------------------------------------------------------------------------ dropout
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_dropout_si_bitwise_and_hf_compared_with_dropout_off(model):
    r = run_parity(ParityOptions(model=model, tp=2, num_layers=2, seq_len=32, dropout=0.1), timeout=280)
    assert r["bitwise_equal"] and r["losses"]["si"] == r["losses"]["sequential"], r
    assert r["hf_close"] and "dropout off" in r["hf_comparison"]
    # HF runs with dropout off, so its losses must differ from the trained legs' by more than
    # rounding: without dropout the legs stay within 3.6e-7 of HF, so 1e-4 is far above that
    gap = max(abs(a - b) for a, b in zip(r["losses"]["sequential"], r["losses"]["hf"]))
    assert gap > 1e-4, r["losses"]


def _dropout_graph(seed=5):
    from hf_models.adapters import adapter_for
    from tests.conftest import make_config, make_model

    config = make_config("tiny-gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    model = make_model(config)
    return model, adapter_for(config).build_graph(model, seed=seed)


def test_dropout_masks_follow_the_micro_batch_number_not_the_process():
    """A fresh graph (a resumed process) draws, for micro-batch number k, the masks an
    uninterrupted run drew for it; another number draws others; eval draws none."""
    from ds_dhelix.runtime.executor import Executor, MicroBatch
    from tests.conftest import make_batches

    batches = make_batches(2048, 8)
    model, graph = _dropout_graph()
    ex = Executor(graph)
    ex.run_microbatches(batches[:4], "si", 0.25, first_serial=0)
    later = [float(mb.loss) for mb in ex.run_microbatches(batches[4:], "si", 0.25, first_serial=4)]
    _, fresh = _dropout_graph()
    again = [float(mb.loss) for mb in Executor(fresh).run_microbatches(batches[4:], "sequential", 0.25, first_serial=4)]
    other = [float(mb.loss) for mb in Executor(fresh).run_microbatches(batches[4:], "si", 0.25, first_serial=0)]
    assert again == later and other != later
    model.eval()
    evals = []
    with ex.inference():
        for serial in (3, 7):
            mb = MicroBatch(0, graph.make_side(batches[0], serial))
            ex.forward(mb)
            evals.append(float(mb.loss))
    assert evals[0] == evals[1]  # no masks in eval, whatever the number


def test_dropout_masks_follow_the_base_seed_not_the_process_rng():
    """Two processes (or a resumed one) seed torch differently; the masks follow dhelix.seed only."""
    from ds_dhelix.runtime.executor import Executor
    from tests.conftest import make_batches

    batches = make_batches(2048, 4)

    def losses(process_seed, base_seed):
        torch.manual_seed(process_seed)
        _, graph = _dropout_graph(seed=base_seed)
        torch.manual_seed(process_seed + 1)  # the process RNG moves on; the masks must not care
        return [float(mb.loss) for mb in Executor(graph).run_microbatches(batches, "si", 0.25, first_serial=0)]

    assert losses(1, 5) == losses(2, 5) and losses(1, 5) != losses(1, 6)
