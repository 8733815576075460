"""dhelix predict (ds_dhelix/predict): the executor's round rules on hand-checkable chains, group
placement and collective times by the alpha-beta model, op costs against the FLOPs the real graph
runs, the step of every schedule, the pipeline replay, the CPU table path and every refusal."""

import json

import pytest
import torch

from ds_dhelix.config.dims import ParallelDims
from ds_dhelix.predict import step as S
from ds_dhelix.predict.costs import OpTime, StepTimes
from ds_dhelix.predict.hardware import load_hardware
from ds_dhelix.predict.links import collective_ms, group_ranks, placement
from ds_dhelix.predict.retime import ChainOp, RoundRules, reactive_rules, retime_pair
from ds_dhelix.predict.shapes import RunLayout, model_shape


def comp(ms, deferred=0.0, depth=0):
    return ChainOp("c", False, ms, deferred, depth)


def comm(ms, depth=0, group="tp", link="tp"):
    return ChainOp("m", True, ms, depth=depth, group=group, link=link)


# ------------------------------------------------------------------------ round rules (retime)
def test_slowdown_stretches_compute_while_a_collective_flies():
    # B computes 2 ms while F's 1 ms collective flies: the first ms of compute runs at 1/1.5 speed
    # (2/3 ms of work done by t=1), the rest (4/3 ms) alone: 7/3 ms
    r = retime_pair([comp(2)], [comm(1)], slowdown=0.5)
    assert r.makespan_ms == pytest.approx(7 / 3)
    assert r.compute_ms == pytest.approx(2.0) and r.wait_ms == pytest.approx(0.0)


def test_collectives_on_different_links_do_not_share():
    same = retime_pair([comm(2)], [comm(2)])
    apart = retime_pair([comm(2, group="tp", link="tp")], [comm(2, group="ep", link="ep")])
    assert same.makespan_ms == pytest.approx(4.0) and apart.makespan_ms == pytest.approx(2.0)


def test_not_reacting_a_done_collective_waits_until_waited_for():
    # F's 1 ms collective is done at 1, but without reacting (CUDA) F goes on only when the compute
    # unit has nothing else: after B's 3 ms of compute, so F's op runs 3-4
    b, f = [comp(3)], [comm(1), comp(1)]
    assert retime_pair(b, f).makespan_ms == pytest.approx(3.0 + 1.0)  # reacting: F's op 3-4 too (B first)
    b, f = [comp(1), comp(1), comp(1)], [comm(1), comp(1)]
    assert retime_pair(b, f).makespan_ms == pytest.approx(4.0)
    # reacting, F's op could run at 1 but B's ops are nearer... none: B has no collective; F's op
    # (one op to no collective) ties: B first; not reacting gives the same here
    assert retime_pair(b, f, rules=reactive_rules(reacts=False)).makespan_ms == pytest.approx(4.0)
    # a chain where reacting matters: F's collective done at 1, F's op feeds a second collective
    b, f = [comp(1), comp(1), comp(1), comp(1)], [comm(1), comp(1), comm(2)]
    react, blind = retime_pair(b, f), retime_pair(b, f, rules=reactive_rules(reacts=False))
    assert react.makespan_ms == pytest.approx(5.0)  # F's op 1-2 (nearest collective), its 2 ms flies 2-4
    assert blind.makespan_ms == pytest.approx(7.0)  # F waited for only at 4: op 4-5, collective 5-7


def test_trailing_backward_follows_op_by_op():
    # the second strand runs position i only after the first ran its own. B0's op 0-1, its
    # collective flies from 1 (alone until 2: 1 ms left); B1's op 1-2; B1's collective from 2 shares
    # the link: B0's done at 4 (B1's has 1 left, alone until 5); B0's op 4-5, then B1's 5-6
    r = retime_pair(
        [comp(1), comm(2), comp(1)], [comp(1), comm(2), comp(1)], rules=reactive_rules(gated=False, trail=True)
    )
    assert r.makespan_ms == pytest.approx(6.0)
    # B1's collective may not start before B0 ran its first op: both fly from 3, sharing the link
    # (done at 5), B1's op 5-6; free, B1's collective flies beside B0's op from 0: done at 4
    b0, b1 = [comp(3), comm(1)], [comm(1), comp(1)]
    assert retime_pair(b0, b1, rules=reactive_rules(gated=False, trail=True)).makespan_ms == pytest.approx(6.0)
    assert retime_pair(b0, b1, rules=reactive_rules(gated=False)).makespan_ms == pytest.approx(4.0)


def test_strand0_order_runs_the_backward_first():
    b, f = [comp(2), comm(1)], [comp(1), comm(3)]
    assert retime_pair(b, f, rules=RoundRules(nearest=False, gated=False)).makespan_ms == pytest.approx(6.0)


def test_round_rules_refuse_nonsense():
    with pytest.raises(ValueError, match="max_deferred"):
        RoundRules(max_deferred=-1)
    with pytest.raises(ValueError, match="slowdown"):
        retime_pair([comp(1)], [], slowdown=-1)


# ------------------------------------------------------------------------ groups and links
def test_groups_follow_the_rank_order():
    dims = ParallelDims(32, tp=8, pp=2, ep=2)  # dp = 2
    assert group_ranks(dims, "tp")[0] == list(range(8))
    assert group_ranks(dims, "replica")[0] == [0, 8]
    assert group_ranks(dims, "ep")[0] == [0, 8] and group_ranks(dims, "edp")[0] == [0]
    assert [0, 16] in group_ranks(dims, "pp")
    assert placement(dims, "tp", 8).nodes == 1
    assert placement(dims, "replica", 8).nodes == 2 and placement(dims, "pp", 8).per_node == 1
    assert placement(ParallelDims(16, tp=16), "tp", 8).nodes == 2


def test_alpha_beta_times_by_hand():
    hw = load_hardware("H100")
    a = hw.assumptions
    inside = placement(ParallelDims(8, tp=8), "tp", 8)
    nbytes = 64e6
    bw = hw.intra_link.gbs * 1e9 * a.link_efficiency
    alpha = a.nccl_base_us + 7 * a.nccl_hop_us["nvlink"]
    assert collective_ms(hw, inside, "all_gather", nbytes) == pytest.approx((7 / 8 * nbytes / bw + alpha * 1e-6) * 1e3)
    across = placement(ParallelDims(16, tp=16), "tp", 8)
    net = hw.node_network_bps * a.link_efficiency * 8 / 8  # 8 of the node's GPUs in the group
    alpha = a.nccl_base_us + 14 * a.nccl_hop_us["nvlink"] + a.nccl_hop_us["net"]
    assert collective_ms(hw, across, "all_gather", nbytes) == pytest.approx(
        (15 / 16 * nbytes / min(bw, net) + alpha * 1e-6) * 1e3
    )
    assert collective_ms(hw, placement(ParallelDims(1), "tp", 8), "all_reduce", nbytes) == 0.0


def test_hardware_presets_and_files(tmp_path):
    for name in ("A40", "A800", "H100", "H200"):
        hw = load_hardware(name)
        assert hw.gpu.source and hw.intra_link.source and hw.network.source
    assert load_hardware("A800", network="ib400", nics_per_node=8).node_network_bps == 8 * 400e9 / 8
    path = tmp_path / "mine.yaml"
    path.write_text(
        "gpu: H100\ngpus_per_node: 4\nintra_link: pcie5\nnetwork: {gbit: 25}\nnics_per_node: 2\n"
        "assumptions: {gemm_efficiency: 0.5}\n"
    )
    hw = load_hardware(str(path))
    assert (hw.gpus_per_node, hw.intra_link.gbs, hw.network.gbit, hw.assumptions.gemm_efficiency) == (4, 64, 25, 0.5)
    path.write_text("gpu: H100\ngpus_per_node: 4\nintra_link: pcie5\nnetwork: ib100\nnics: 2\n")
    with pytest.raises(ValueError, match="nics"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="did you mean 'H100'"):
        load_hardware("H10")
    with pytest.raises(ValueError, match="ib400"):
        load_hardware("H100", network="ib500")


# ------------------------------------------------------------------------ op costs vs the real graph
def _graph_flops(preset: str, batch: int, seq: int):
    """Every op's forward FLOPs as torch counts them running the real op graph (one rank, fp32),
    and the model's outline and shape."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_models.adapters import adapter_for
    from hf_models.outline import model_outline
    from hf_models.registry import build_model

    model = build_model(preset, seed=0)[0]
    adapter = adapter_for(model.config)
    options = {"ep_groups": None} if hasattr(adapter, "check_ep") else {}
    graph = adapter.build_graph(model, 1, 0, None, None, seed=0, **options)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    side, env, counted = graph.make_side({"input_ids": ids, "labels": ids}, 0), {}, {}
    with torch.no_grad():
        for b, block in enumerate(graph.blocks):
            for op in block:
                with FlopCounterMode(display=False) as fc:
                    outs = op.fn(side, *(env[k] for k in op.inputs))
                env.update(zip(op.outputs, outs))
                counted[(b, op.name)] = fc.get_total_flops()
    outline = model_outline(model.config, ParallelDims(1))
    assert [[o.name for o in b] for b in outline.blocks] == [[o.name for o in b] for b in graph.blocks]
    return counted, outline, model_shape(model.config)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-phimoe", "tiny-deepseek-v3", "tiny-gpt2", "tiny-qwen2-moe"])
def test_projection_flops_match_what_the_graph_runs(preset):
    """The meta-device outline names the real graph's ops; the roofline's GEMM FLOPs of every op
    (projections, head, router, experts, shared experts, MLA's latent projections) equal what torch
    counts when the real op graph runs (routing is exact at EP=1: every token's top-k copies reach
    the experts)."""
    from ds_dhelix.predict.costs import block_context
    from ds_dhelix.predict.roofline import op_work

    counted, outline, shape = _graph_flops(preset, 2, 64)
    layout = RunLayout(ParallelDims(1), 64, 2, 1, "fp32")
    checked = 0
    for (b, name), flops in counted.items():
        work = op_work(name, block_context(shape, layout, outline, b))
        predicted = sum(k.flops for k in work.fwd if k.kind == "gemm")
        if name == "attn.core":  # sdpa on CPU is not counted by torch's flop counter
            continue
        assert predicted == pytest.approx(flops, rel=1e-6), (b, name, predicted, flops)
        checked += flops > 0
    assert checked >= 4 * shape.num_layers  # the projections of every layer were compared


# ------------------------------------------------------------------------ schedules of a step
def _times(f_comp=1.0, b_comp=2.0, comm_ms=1.0, layers=2, wgrad=0.5, slowdown=0.0) -> StepTimes:
    """A hand-made model: embedding and head of 0.5 ms each way, layers [compute, collective,
    compute (linear)]."""
    edge = (OpTime("e", False, 0.5, 0.5),)
    layer = (
        OpTime("a", False, f_comp, b_comp),
        OpTime("m", True, comm_ms, comm_ms, group="tp", link="tp"),
        OpTime("l", False, f_comp, b_comp - wgrad, wgrad, linear=True),
    )
    return StepTimes((edge,) + (layer,) * layers + (edge,), {"optimizer": 3.0}, 0.0, slowdown, reacts=True)


def _step(name: str, st: StepTimes, m: int, half=None, plan=None):
    """A one-stage step priced from the registry's instruction list of ``name``."""
    from ds_dhelix.schedule.registry import ONE_STAGE, lookup

    return S.schedule_step(lookup(name, ONE_STAGE), m, st, half, plan)


def test_sequential_is_the_sum():
    st = _times()
    lap = _step("sequential", st, 4)
    assert lap.ms == pytest.approx(4 * (st.compute_ms() + st.comm_ms())) and lap.wait_ms == pytest.approx(
        4 * st.comm_ms()
    )


def test_si_hides_and_never_beats_the_compute():
    st, m = _times(), 8
    seq, si = _step("sequential", st, m), _step("si", st, m)
    assert m * st.compute_ms() <= si.ms < seq.ms and si.wait_ms < seq.wait_ms
    quiet = _times(comm_ms=0.0)  # nothing to hide: SI is the sequential step
    assert _step("si", quiet, m).ms == pytest.approx(_step("sequential", quiet, m).ms)
    slow = _times(slowdown=1.0)  # compute beside collectives at half speed: less gained
    assert _step("si", slow, m).ms > si.ms


def test_si_is_its_instruction_list_priced():
    """F0 alone, m-1 identical pairs, B(m-1) alone: the price of each from the round policy."""
    st, m = _times(), 5
    from ds_dhelix.schedule import instructions as I
    from ds_dhelix.schedule.registry import ONE_STAGE, lookup

    spec = lookup("si", ONE_STAGE)
    f = S.price(I.Forward(0), spec, st, (st, st), None)
    fb = S.price(I.ForwardBackward(1, 0, 0, 0), spec, st, (st, st), None)
    b = S.price(I.Backward(4), spec, st, (st, st), None)
    assert _step("si", st, m).ms == pytest.approx(f.ms + (m - 1) * fb.ms + b.ms)
    fwd = sum(o.fwd_ms for blk in st.blocks for o in blk)
    bwd = sum(o.bwd_ms + o.wgrad_ms for blk in st.blocks for o in blk)
    assert f.ms == pytest.approx(fwd)  # a lone forward waits for every collective
    assert b.ms < bwd  # a lone backward's deferred weight gradients fill its collectives' waits


def test_pair_ends_and_intra_and_plans_run():
    st, m = _times(), 6
    assert _step("si-ends", st, m).ms < _step("sequential", st, m).ms
    half = _times(0.5, 1.0, 0.5, wgrad=0.25)
    intra = _step("intra", st, m, half=(half, half))
    assert m * half.compute_ms() * 2 <= intra.ms <= _step("sequential", st, m).ms
    chosen = S.plans(st)
    assert chosen["dp_ms"] <= chosen["default_ms"] + 1e-9  # the DP plan is never predicted slower
    for name, plan in (("si-plan", chosen["default"]), ("si-planned", chosen["dp"])):
        assert m * st.compute_ms() <= _step(name, st, m, plan=plan).ms <= _step("sequential", st, m).ms + 1e-9


def test_pipeline_replay_matches_the_w_closed_form():
    """Without collectives a chunk pair cannot overlap (c = F + B) and the W schedule's replayed
    makespan is the closed form 2pF + 2(m-1)c + 2pB (pipe/simulate.py's derivation)."""
    from ds_dhelix.predict.pipeline import chunk_costs, pipeline_step

    st = StepTimes(
        ((OpTime("e", False, 0.0, 0.0),),)
        + ((OpTime("a", False, 1.0, 2.0),),) * 8
        + ((OpTime("e", False, 0.0, 0.0),),),
        {},
        0.0,
        0.0,
        True,
    )
    p, m = 2, 6
    k = chunk_costs(st, 8, p)
    F, B, c = k["F"].ms, k["B"].ms, k["c"].ms
    assert (F, B, c) == pytest.approx((2.0, 4.0, 6.0))
    lap, bubble = pipeline_step(st, "w", 8, p, m)
    assert lap.ms == pytest.approx(2 * p * F + 2 * (m - 1) * c + 2 * p * B)
    assert bubble == pytest.approx((p - 1) * c / (p * (F + B) + (m - 1) * c))
    one_f_one_b, _ = pipeline_step(st, "ds-1f1b", 8, p, m)
    assert one_f_one_b.ms == pytest.approx((m + p - 1) * 2 * (F + B))
    with pytest.raises(ValueError, match="num_microbatches >= p \\+ 1"):
        pipeline_step(st, "w", 8, 4, 4)


# ------------------------------------------------------------------------ the command
def _predict(capsys, *argv):
    from ds_dhelix.cli import main

    code = main(["predict", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_predict_json_on_a_gpu_preset(capsys):
    code, out, _ = _predict(
        capsys,
        "--model",
        "tiny-phimoe",
        "--tp",
        "2",
        "--ep",
        "2",
        "--seq-len",
        "128",
        "--micro-batches",
        "4",
        "--hardware",
        "A800",
        "--json",
    )
    assert code == 0
    r = json.loads(out)
    assert set(r["modes"]) == {"sequential", "si", "si-ordered", "si-ends", "si-plan", "si-planned", "intra"}
    # a GPU never reacts to completed collectives: si is priced in the order si-ordered names
    assert r["modes"]["si"]["step_time_s"] == r["modes"]["si-ordered"]["step_time_s"]
    for row in r["modes"].values():
        assert row["step_time_s"] > 0 and 0 <= row["exposed_comm_s"] < row["step_time_s"]
        assert row["tokens_per_s"] == pytest.approx(r["layout"]["tokens_per_step"] / row["step_time_s"])
    assert r["layout"]["world"] == 4 and r["si_gain"]["baseline"] == "sequential"
    assert r["assumptions"]["comm_slowdown"] == 0.25 and r["hardware"]["gpu"]["source"]


def test_predict_pipeline_schedules(capsys):
    code, out, _ = _predict(
        capsys,
        "--model",
        "small-llama",
        "--tp",
        "8",
        "--pp",
        "2",
        "--dp",
        "4",
        "--seq-len",
        "2048",
        "--micro-batch-size",
        "1",
        "--micro-batches",
        "8",
        "--hardware",
        "H100",
        "--json",
    )
    r = json.loads(out)
    assert code == 0 and set(r["modes"]) == {"ds-1f1b", "ds-dualpipev", "sequential", "w", "dualpipev"}
    assert r["modes"]["sequential"]["bubble_fraction"] >= 0.5  # 1 - 1/p, and the transfers between stages
    assert r["modes"]["w"]["step_time_s"] < r["modes"]["sequential"]["step_time_s"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hardware", "cpu"], "needs --table"),
        (["--hardware", "cpu", "--table", "t.json"], "needs --link-gbps"),
        (["--hardware", "H100", "--link-gbps", "2"], "feed --hardware cpu"),
        (["--hardware", "cpu", "--table", "t.json", "--link-gbps", "2", "--nics-per-node", "2"], "GPU system"),
        (["--hardware", "H100", "--schedule", "w"], "pipeline mode"),
        (["--hardware", "H100", "--micro-batch-size", "1", "--schedule", "intra"], "micro-batch-size >= 2"),
        (["--hardware", "H100", "--pp", "2", "--micro-batches", "2", "--schedule", "w"], "p \\+ 1 = 3"),
        (["--hardware", "H100", "--ep", "2"], "no experts"),
        (["--hardware", "H200x"], "did you mean 'H200'"),
        (["--hardware", "H100", "--network", "ib250"], "ib200"),
    ],
)
def test_predict_refuses_bad_input(capsys, argv, message):
    import re

    code, _, err = _predict(capsys, *argv)
    assert code == 2 and re.search(message, err), err
    assert err.startswith("dhelix predict: error:") and err.count("\n") == 1


# ------------------------------------------------------------------------ checked against the bench
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_cpu_projection_against_a_small_bench(tmp_path):
    """The comparison of docs/guides/predict.md, small: profile tiny-llama TP=2 (unshaped), bench
    sequential and SI at 2 Gbit/s, predict both from the table. A gross-error bound only (a factor
    of 2 on a shared 2-core machine): it catches a unit, a missing micro-batch or a wrong byte
    count, not the model's accuracy, which the docs report from full runs."""
    from benchmarks.predict_check import compare
    from ds_dhelix.bench import run_bench
    from ds_dhelix.bench.options import BenchOptions
    from ds_dhelix.bench.profile_runs import profile_world
    from ds_dhelix.bench.report import write_outputs

    opts = {
        "model": "tiny-llama",
        "tp": 2,
        "micro_batch_size": 2,
        "seq_len": 64,
        "warmup": 1,
        "repeats": 2,
        "link_gbps": None,
        "unfused": False,  # fused runs, as the bench's engine runs them and predict prices them
    }
    table, _ = profile_world(opts, timeout=300)
    assert table.fused
    table.save(str(tmp_path / "table-unshaped.json"))
    bench = BenchOptions(
        model="tiny-llama",
        tp=2,
        modes=("sequential", "si"),
        link_gbps=(2.0,),
        micro_batches=4,
        micro_batch_size=2,
        seq_len=64,
        warmup=1,
        repeats=3,
        timeout=240,
    )
    write_outputs(run_bench(bench), str(tmp_path))
    (row,) = compare(str(tmp_path))
    for mode in ("sequential", "si"):
        assert 0.5 < row[mode]["predicted_s"] / row[mode]["measured_s"] < 2.0, row
    assert row["speedup"]["predicted"] >= 1.0  # collectives to hide: SI is never predicted slower


# ------------------------------------------------------------------------ the CPU path
def _cpu_table(cpu_ms: float = 0.3):
    """A hand-made overlap table of tiny-llama's layer at TP=2 (4 x 256 tokens): op i takes i+1 ms
    forward and 2(i+1) backward (a collective 1 ms each way, of which ``cpu_ms`` CPU beside the
    main thread; one outlier)."""
    from ds_dhelix.graph.ops import backward_order
    from ds_dhelix.planning.planner import EMPTY, LLAMA_LAYER_OPS, OverlapTable

    fwd = LLAMA_LAYER_OPS
    bwd = backward_order(fwd)
    n = len(fwd)
    table = OverlapTable(
        {"layout": "world=2,tp=2,ep=1", "batch_shape": [4, 256], "dtype": "float32", "link_gbps": None}, fwd, bwd
    )
    f_ms = {i: 1.0 if fwd[i].is_comm else i + 1.0 for i in range(n)}
    b_ms = {j: 1.0 if bwd[j].is_comm else 2.0 * (n - j) for j in range(n)}
    for i in range(n):
        table.set_entry(((i, i + 1), EMPTY), f_ms[i])
        table.set_entry((EMPTY, (i, i + 1)), b_ms[i])
    table.comm_cpu_ms = {
        "fwd": [cpu_ms if op.is_comm else None for op in fwd],
        "bwd": [cpu_ms if op.is_comm else None for op in bwd],
    }
    table.comm_cpu_ms["fwd"][1] = 5.0  # one rank's outlier run: the median ignores it
    table.block_ops = {
        "pre": {"ops": ["embed", "embed.rs"], "fwd_ms": [0.5, 1.0], "bwd_ms": [0.7, 1.0]},
        "post": {
            "ops": ["head.norm", "head.ag", "head.logits", "head.lse", "head.lse_a2a", "head.loss"],
            "fwd_ms": [0.1, 1.0, 3.0, 2.0, 1.0, 0.1],
            "bwd_ms": [0.2, 1.0, 6.0, 4.0, 1.0, 0.1],
        },
    }
    return table


def test_cpu_times_come_from_the_table():
    from ds_dhelix.predict.cpu import comm_cpu_per_collective, table_times
    from hf_models.outline import model_outline
    from hf_models.registry import load_config

    config, dims = load_config("tiny-llama"), ParallelDims(2, tp=2)
    outline, shape = model_outline(config, dims), model_shape(config)
    layout = RunLayout(dims, 256, 4, 16, "fp32")
    table = _cpu_table(cpu_ms=0.3)
    assert comm_cpu_per_collective(table) == pytest.approx(0.3)
    unshaped, slow = table_times(table, outline, shape, layout, None), table_times(table, outline, shape, layout, 1.0)
    layer = {o.name: o for o in unshaped.blocks[1]}
    assert layer["attn.qkv"].fwd_ms == 3.0 and layer["attn.qkv"].bwd_ms + layer["attn.qkv"].wgrad_ms == 2.0 * 3
    assert layer["attn.qkv"].wgrad_ms == pytest.approx(3.0)  # a GEMM: input and weight gradient alike
    assert layer["attn.core"].wgrad_ms == 0.0 and layer["attn.core"].bwd_ms == 2.0 * 4
    # the all-gather moves 4 x 256 x 128 fp32 per rank, half of it to the other rank, both ranks
    # through one loopback at 1 Gbit/s: 524288 B / 125 MB/s = 4.19 ms, longer than gloo's 1 ms
    assert layer["attn.ag"].fwd_ms == 1.0
    assert {o.name: o for o in slow.blocks[1]}["attn.ag"].fwd_ms == pytest.approx(524288 / 125e6 * 1e3)
    head = {o.name: o for o in unshaped.blocks[-1]}
    assert head["head.logits"].fwd_ms == 3.0 and head["head.logits"].wgrad_ms == pytest.approx(3.0)
    # unshaped, 0.3 of each 1 ms collective is CPU taken from compute: 0.3 / 0.7 slower; behind the
    # shaped link the same CPU work spreads over a 4x longer collective: less slowdown
    assert 0 < slow.slowdown < unshaped.slowdown == pytest.approx(0.3 / 0.7)
    with pytest.raises(ValueError, match="batch_shape"):
        table_times(table, outline, shape, RunLayout(dims, 128, 4, 16, "fp32"), None)
    with pytest.raises(ValueError, match=r"the ops one by one \(--unfused\), predict prices fused runs"):
        table_times(table, model_outline(config, dims, fused=True), shape, layout, None)
    table.meta["link_gbps"] = 2.0
    with pytest.raises(ValueError, match="profile unshaped"):
        table_times(table, outline, shape, layout, 1.0)


def test_fused_runs_priced_as_the_engine_runs_them(capsys):
    """By default predict prices the engine's fused runs (``fuse_ops``): each run of COMP ops
    between two collectives is one op whose forward, backward and deferrable weight gradient are
    its members' (a member that is not linear keeps its weight gradient in the backward), the
    names the engine gives it; what a step adds once is read from the members (the router, the
    gathers) and does not change; ``--unfused`` prices the ops one by one."""
    from ds_dhelix.graph.ops import comm_runs
    from ds_dhelix.predict.costs import block_context, kernel_ms, roofline_times
    from ds_dhelix.predict.roofline import op_work
    from hf_models.outline import config_of, model_outline

    config, dims = config_of("tiny-qwen3-moe"), ParallelDims(4, tp=2, ep=2)
    layout, hw = RunLayout(dims, seq_len=128, micro_batch_size=1, micro_batches=4), load_hardware("H100")
    outline, shape = model_outline(config, dims), model_shape(config)
    one, fused = (roofline_times(o, shape, layout, hw) for o in (outline, model_outline(config, dims, fused=True)))
    folded = 0  # ops not linear whose weight gradient (a norm's) is priced in their backward, not deferred
    for b, ops in enumerate(one.blocks):
        for o in ops:
            w = op_work(o.name, block_context(shape, layout, outline, b))
            if not (o.comm or o.linear):
                assert o.wgrad_ms == 0.0
                assert o.bwd_ms == pytest.approx(sum(kernel_ms(hw, k, layout.dtype) for k in w.bwd + w.wgrad))
                folded += bool(w.wgrad)
    assert folded
    assert fused.tail == pytest.approx(one.tail) and fused.compute_ms() == pytest.approx(one.compute_ms())
    mixed = 0
    for b, (ops, got) in enumerate(zip(one.blocks, fused.blocks)):
        runs = [ops[lo:hi] for lo, hi in comm_runs(S.specs_of(one, b))]  # each collective alone, the COMP ops between
        assert [o.name for o in got] == ["+".join(o.name for o in run) for run in runs]
        for run, o in zip(runs, got):
            assert o.fwd_ms == pytest.approx(sum(m.fwd_ms for m in run))
            assert o.wgrad_ms == pytest.approx(sum(m.wgrad_ms for m in run))  # non-linear members: 0 there
            assert o.bwd_ms == pytest.approx(sum(m.bwd_ms for m in run))
            assert o.linear == any(m.linear for m in run)
            mixed += o.linear and not all(m.linear for m in run)
    assert mixed and len(fused.blocks[1]) < len(one.blocks[1])  # e.g. attn.qkv + attn.core + attn.out

    argv = ["--model", "tiny-qwen3-moe", "--tp", "2", "--ep", "2", "--seq-len", "128", "--hardware", "H100", "--json"]
    runs = {}
    for flags in ((), ("--unfused",)):
        code, out, _ = _predict(capsys, *argv, *flags)
        assert code == 0, out
        runs[flags] = json.loads(out)
    assert runs[()]["layout"]["fuse_ops"] and not runs[("--unfused",)]["layout"]["fuse_ops"]
    seq = [r["modes"]["sequential"]["step_time_s"] for r in runs.values()]
    assert seq[0] == pytest.approx(seq[1])  # one strand: the same work in the same order


def test_dp_reduction_during_the_last_backward_against_after_it(capsys):
    """The data-parallel reduction run during the last backward (the engine's default) waits only
    for what outlasts the backward; ``--dp-end`` keeps it whole after it. By hand: each block's
    share starts as its backward ends, one after another; the embedding's and the replicated
    weights' shares after the backward's end."""
    from ds_dhelix.predict.costs import block_params, overlap_dp_grads
    from hf_models.outline import config_of, model_outline

    argv = ["--model", "tiny-llama", "--tp", "2", "--dp", "4", "--seq-len", "128", "--hardware", "A40", "--json"]
    runs = {}
    for flags in ((), ("--dp-end",)):
        code, out, _ = _predict(capsys, *argv, *flags)
        assert code == 0
        runs[flags] = json.loads(out)
    during, after = runs[()], runs[("--dp-end",)]
    whole = after["per_step"]["tail_s"]["dp_grads"]
    assert during["per_step"]["dp_grads_whole_s"] == pytest.approx(whole) and whole > 0
    exposed = during["per_step"]["tail_s"]["dp_grads"]
    assert 0 < exposed < whole
    for mode, row in during["modes"].items():  # the steps differ by exactly the hidden part
        gap = after["modes"][mode]["step_time_s"] - row["step_time_s"]
        assert gap == pytest.approx(whole - exposed)
    assert during["layout"]["overlap_grad_reduction"] and not after["layout"]["overlap_grad_reduction"]

    config = config_of("tiny-llama")
    layout = RunLayout(ParallelDims(8, tp=2), seq_len=128, micro_batch_size=1, micro_batches=4)
    outline, shape = model_outline(config, layout.dims), model_shape(config)
    params = block_params(shape, outline, layout)
    blocks = [(OpTime("x", False, 0.0, 1.0),)] * len(outline.blocks)  # 1 ms of backward per block
    tail, notes = overlap_dp_grads({"dp_grads": 100.0}, blocks, shape, outline, layout)
    clock = done = 0.0
    for b in reversed(range(len(blocks))):
        clock += 1.0
        done = max(done, clock) + 100.0 * params[b] / sum(params)
    assert tail["dp_grads"] == pytest.approx(done + 100.0 * params[-1] / sum(params) - clock)
    assert notes["dp_grads_ms"]["whole"] == 100.0


def test_zero3_gathers_and_reduce_scatters_every_block(capsys):
    """``--zero-stage 3``: every block gains ``z3.in`` / ``z3.out`` (forward: a gather of the
    block's parameters; backward: a reduce-scatter and a gather), the dense ones on the
    data-parallel group, the expert shards on their expert-data-parallel group (by hand below);
    the step has no data-parallel reduction of its own, and costs more than stage 2."""
    from ds_dhelix.predict.costs import _layer_params, block_params, zero3_blocks
    from hf_models.outline import config_of, model_outline

    argv = ["--model", "tiny-qwen3-moe", "--dp", "8", "--ep", "2", "--seq-len", "128", "--hardware", "A10"]
    runs = {}
    for stage in ("2", "3"):
        code, out, _ = _predict(capsys, *argv, "--network", "eth25", "--zero-stage", stage, "--json")
        assert code == 0, out
        runs[stage] = json.loads(out)
    two, three = runs["2"], runs["3"]
    assert three["per_step"]["tail_s"]["dp_grads"] == 0 < two["per_step"]["tail_s"]["dp_grads"]
    assert three["modes"]["sequential"]["step_time_s"] > two["modes"]["sequential"]["step_time_s"]
    assert three["modes"]["si"]["step_time_s"] < three["modes"]["sequential"]["step_time_s"]

    hw = load_hardware("A10", network="eth25")
    config = config_of("tiny-qwen3-moe")
    layout = RunLayout(ParallelDims(8, ep=2), seq_len=128, micro_batch_size=1, micro_batches=4, zero_stage=3)
    outline, shape = model_outline(config, layout.dims), model_shape(config)
    places = {k: placement(layout.dims, k, hw.gpus_per_node) for k in ("replica", "edp")}
    blocks = [(OpTime("x", False, 1.0, 1.0),)] * len(outline.blocks)
    out = zero3_blocks(hw, blocks, shape, outline, layout, places)
    assert [len(b) for b in out] == [3] * len(blocks) and [b[0].name for b in out] == ["z3.in"] * len(blocks)
    params = block_params(shape, outline, layout)
    experts = _layer_params(shape, outline.blocks[1], 1)[2] / 2  # layer 0's expert shards of one EP rank
    dense = (params[1] - experts) * layout.bytes
    z_in, z_out = out[1][0], out[1][-1]
    for kind, got in (("all_gather", z_in.fwd_ms), ("reduce_scatter", z_in.bwd_ms), ("all_gather", z_out.bwd_ms)):
        by_hand = collective_ms(hw, places["replica"], kind, dense)
        by_hand += collective_ms(hw, places["edp"], kind, experts * layout.bytes)
        assert got == pytest.approx(by_hand) and experts > 0
    assert z_out.fwd_ms == 0.0
