"""Context parallelism (Ulysses): the sequence sharded over CP ranks, attention through explicit
all-to-alls (``attn.a2a_in`` / ``attn.a2a_out`` COMM ops).

    parity     CP=2 SI bitwise equal to CP=2 sequential and close to unsharded HF (first-step
               gradients and every loss): tiny-llama at seq 512, GPT-2, Phi-MoE (aux loss over the
               TP x CP ranks), TP=2 x CP=2 on 4 ranks (kv heads shared by two query-head groups)
    layout     ranks and groups of TP x CP, DeepSpeed's data-parallel group DP x CP
    with EP    CP=2 x EP=2 on 4 ranks (experts sharded per CP rank, replicated over EDP x CP)
    with PP    CP=2 inside each stage of a PP=2 folded pipeline (W), bitwise equal to PP=1
    refused    heads that do not split, sequence lengths that do not divide
               (ring attention: test_ring_attention.py)
"""

import pytest
import torch

from ds_dhelix.config.dims import ParallelDims
from ds_dhelix.engine.build import check_setup
from ds_dhelix.verify import ParityOptions, run_parity
from hf_models.common import kv_heads_of_groups
from hf_models.registry import load_config


def _config(cp=2, tp=1, **dhelix):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "dhelix": {"enabled": True, "tensor_parallel": {"size": tp}, "context_parallel": {"size": cp}, **dhelix},
    }


# ------------------------------------------------------------------ layout and refusals (no ranks)
def test_rank_order_and_data_parallel_size():
    dims = ParallelDims(8, tp=2, cp=2)
    assert dims.dp == 2 and dims.shards == 4
    # TP innermost, then CP, then DP: rank = (dp_rank * cp + cp_rank) * tp + tp_rank
    assert [tuple(dims.coords(r)) for r in (0, 1, 2, 3, 4)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 0, 1, 1),
        (0, 1, 0, 0),
    ]
    assert all(dims.rank_of(*dims.coords(r)) == r for r in range(8))


def test_batch_counts_data_parallel_replicas_only():
    setup = check_setup(_config(cp=2), load_config("tiny-llama"), 4)
    assert setup.dims.dp == 2 and setup.batch.train_batch_size == 1 * 2 * 2  # CP ranks share each sample


def test_kv_heads_of_query_groups():
    assert kv_heads_of_groups(4, 2, 2) == [slice(0, 1), slice(1, 2)]  # one kv head each
    assert kv_heads_of_groups(2, 1, 2) == [slice(0, 1), slice(0, 1)]  # both groups share the one head
    assert kv_heads_of_groups(8, 2, 4) == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]


@pytest.mark.parametrize(
    "world,tp,cp,model,words",
    [
        (
            8,
            1,
            8,
            "tiny-llama",
            ["context_parallel.size 8", "num_attention_heads=4", "valid context_parallel.size", "[1, 2, 4]"],
        ),
        (8, 2, 4, "tiny-gpt2", ["context_parallel.size 4 with tensor_parallel.size 2", "[1, 2]"]),
    ],
)
def test_heads_that_do_not_split_are_refused(world, tp, cp, model, words):
    with pytest.raises(ValueError) as err:
        check_setup(_config(cp=cp, tp=tp), load_config(model), world)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize(
    "dhelix,words",
    [
        ({"context_parallel": {"size": 2, "comm": "ulyses"}}, ["dhelix.context_parallel.comm", "ulysses, ring"]),
        ({"context_parallel": {"size": 0}}, ["dhelix.context_parallel.size = 0", ">= 1"]),
    ],
)
def test_combinations_not_built_are_refused(dhelix, words):
    cfg = _config()
    cfg["dhelix"].update(dhelix)
    model = "tiny-phimoe" if "expert_parallel" in dhelix else "tiny-llama"
    with pytest.raises(ValueError) as err:
        check_setup(cfg, load_config(model), 4)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_world_not_divisible_names_cp():
    with pytest.raises(ValueError, match="context_parallel.size 2 = 4"):
        check_setup(_config(cp=2, tp=2), load_config("tiny-llama"), 6)


def test_sequence_length_not_divisible_by_the_shards():
    from ds_dhelix.runtime.groups import ContextShards
    from hf_models.common import make_side_fn

    make_side = make_side_fn(2, 0, cp=ContextShards(2, 1, None))
    ids = torch.arange(12).view(1, 12)
    with pytest.raises(
        ValueError, match="sequence length 10 is not divisible by tensor_parallel.size 2 x context_parallel.size 2 = 4"
    ):
        make_side({"input_ids": ids[:, :10]})
    side = make_side({"input_ids": ids})  # CP rank 1, TP rank 0: shard 2 of 4; targets shifted before cutting
    assert side["ids"].tolist() == [[6, 7, 8]] and side["targets"].flatten().tolist() == [7, 8, 9]
    assert side["positions"].tolist() == [[6, 7, 8]]


# ------------------------------------------------------------------ parity (real ranks)
def _parity(**kw):
    opts = ParityOptions(**{"tp": 1, "cp": 2, "schedule": "si", "steps": 2, "micro_batches": 2, "num_layers": 2, **kw})
    return run_parity(opts, timeout=400)


def _assert_parity(res):
    assert res["bitwise_equal"], res["losses"]
    # fp32: CP changes only which rank sums which tokens' terms (the loss sum over CP, gradients
    # summed by DeepSpeed's DP x CP reduction), and ring attention computes each block's softmax
    # itself and merges the blocks by log-sum-exp where HF runs one softmax over the row:
    # rounding, far below what a wrong shard, mask, chunk order or merge weight would move
    assert res["hf_close"], (res["max_abs_diff_vs_hf"], res["max_loss_diff_vs_hf"])
    assert res["max_loss_diff_vs_hf"] < 1e-5 and res["max_abs_diff_vs_hf"] < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_llama_cp2_at_seq_512_matches_hf():
    res = _parity(model="tiny-llama", seq_len=512, micro_batch_size=1)
    _assert_parity(res)
    assert res["losses"]["hf"][0] > 7.0  # a real loss on random tokens, not a degenerate one


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-phimoe"])
def test_cp2_parity(model):
    _assert_parity(_parity(model=model, zero_stage=2))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_cp2_on_four_ranks():
    # tiny-llama: 2 kv heads, 1 per TP rank: both CP query-head groups of a TP rank share it
    _assert_parity(_parity(model="tiny-llama", tp=2, micro_batches=4, steps=1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_with_expert_parallelism_on_four_ranks():
    # EP groups hold one CP rank's tokens; an expert's gradient is reduced over EDP x CP, as the
    # dense weights' over DP x CP: a group missing its CP ranks halves the experts' updates and
    # moves the later losses away from HF's
    _assert_parity(
        _parity(
            model="tiny-phimoe", dp=2, extra={"expert_parallel": {"size": 2}}, steps=2, micro_batches=2, zero_stage=2
        )
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_inside_pipeline_stages():
    from ds_dhelix.verify import run_pipe_parity

    # clipping off: the clip factor's norm is summed per stage (last-bit differences otherwise)
    res = run_pipe_parity(
        ParityOptions(model="tiny-llama", tp=1, cp=2, pp=2, schedule="w", steps=2, micro_batches=4, clip=0.0),
        timeout=400,
    )
    assert res["bitwise_equal"], res["losses"]
    assert res["hf_close"], (res["max_abs_diff_vs_hf"], res["max_loss_diff_vs_hf"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm,names", [("ulysses", {"attn.a2a_in", "attn.a2a_out"}), ("ring", {"attn.kv1"})])
def test_trace_has_the_cp_exchanges_on_their_lanes(tmp_path, comm, names):
    from ds_dhelix.bench.tracing import TraceOptions, record_trace
    from ds_dhelix.runtime.trace import validate_trace

    out = tmp_path / "trace.json"
    record_trace(
        TraceOptions(
            out=str(out),
            model="tiny-llama",
            tp=1,
            cp=2,
            cp_comm=comm,
            steps=1,
            micro_batches=3,
            micro_batch_size=1,
            seq_len=64,
            num_layers=2,
            timeout=200,
        )
    )
    import json

    trace = json.loads(out.read_text())
    assert validate_trace(trace, lanes=("compute", "comm:cp:F", "comm:cp:B")) == []
    lanes = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    spans = [(lanes[(e["pid"], e["tid"])], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    seen = {name for lane, name in spans if lane.startswith("comm:cp")}
    assert seen == names, seen
    # 2 layers x (2 all-to-alls, or 1 ring step) x 3 micro-batches x (forward + backward) per rank, 2 ranks
    assert sum(lane.startswith("comm:cp") for lane, _ in spans) == 2 * len(names) * 3 * 2 * 2


def test_bench_options_with_cp():
    from ds_dhelix.bench.options import BenchOptions

    opts = BenchOptions(tp=1, cp=2, modes=("deepspeed", "sequential", "si"), seq_len=1024)
    assert opts.world == 2 and opts.dp == 1
    assert opts.dhelix_ds_config("si")["dhelix"]["context_parallel"] == {"size": 2, "comm": "ulysses"}
    with pytest.raises(ValueError, match="no context parallelism to compare"):
        BenchOptions(tp=1, cp=2, modes=("autotp", "si"))
    with pytest.raises(
        ValueError, match="seq-len 250 is not divisible by tensor_parallel.size 1 x context_parallel.size 4 = 4"
    ):
        BenchOptions(tp=1, cp=4, modes=("si",), seq_len=250)
    with pytest.raises(
        ValueError, match="seq-len 260 is not divisible by 2 x tensor_parallel.size 1 x context_parallel.size 4 = 8"
    ):
        BenchOptions(tp=1, cp=4, cp_comm="ring", modes=("si",), seq_len=260)
