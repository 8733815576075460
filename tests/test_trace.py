"""Trace writer: valid Chrome JSON, named lanes, overlap detection, merging ranks."""

import json
import time

import pytest

from ds_dhelix.runtime.trace import TraceRecorder, merge_traces, span_args, validate_trace


def _recorder(rank, **kw):
    rec = TraceRecorder(rank, **kw)
    for mb in range(2):
        with rec.span("compute", "attn.qkv", span_args("alpha", mb, "attn.qkv")):
            time.sleep(0.001)
        t0 = time.perf_counter()
        with rec.span("compute", "mlp.fc1", span_args("beta", mb, "mlp.fc1")):
            time.sleep(0.001)
        rec.add_span("comm:tp", "attn.rs", t0, time.perf_counter(), span_args("alpha", mb, "attn.rs"))
    return rec


def test_dump_is_valid_chrome_trace(tmp_path):
    path = _recorder(3).dump(tmp_path / "rank3.json")
    trace = json.loads(open(path).read())
    assert trace["displayTimeUnit"] == "ms"
    assert validate_trace(trace, lanes=("compute", "comm:tp")) == []
    events = trace["traceEvents"]
    names = {(e["name"], e["args"].get("name")) for e in events if e["ph"] == "M"}
    assert ("process_name", "rank 3") in names
    assert {("thread_name", "compute"), ("thread_name", "comm:tp")} <= names
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and all(e["pid"] == 3 for e in spans)
    assert len({e["tid"] for e in spans}) == 2
    qkv = next(e for e in spans if e["name"] == "attn.qkv")
    assert qkv["args"] == {"strand": "alpha", "microbatch": 0, "op": "attn.qkv"}
    assert 900 < qkv["dur"] < 1e6  # microseconds: a 1 ms sleep


def test_validate_detects_overlap_unsorted_and_missing_lanes():
    rec = TraceRecorder(0)
    rec.add_span("compute", "a", 1.0, 2.0)
    rec.add_span("compute", "b", 1.5, 2.5)  # overlaps "a"
    trace = {"traceEvents": rec.events()}
    problems = validate_trace(trace, lanes=("comm:ep",))
    assert any("overlap" in p and "'b'" in p for p in problems)
    assert any("no lane 'comm:ep'" in p for p in problems)

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    spans[1]["ts"] = 2.0e6  # no overlap any more, but listed out of order
    problems = validate_trace({"traceEvents": meta + spans[::-1]})
    assert len(problems) == 1 and "unsorted" in problems[0]

    no_names = {"traceEvents": spans}
    assert any("thread_name" in p for p in validate_trace(no_names))
    assert validate_trace([]) != [] and validate_trace({"traceEvents": [{"ph": "X"}]}) != []


def test_touching_spans_and_disabled_recorder(tmp_path):
    rec = TraceRecorder(0)
    rec.add_span("compute", "a", 1.0, 2.0)
    rec.add_span("compute", "b", 2.0, 3.0)
    assert validate_trace({"traceEvents": rec.events()}) == []
    with pytest.raises(ValueError, match="before start"):
        rec.add_span("compute", "c", 2.0, 1.0)

    off = TraceRecorder(1, enabled=False)
    with off.span("compute", "x"):
        pass
    off.add_span("compute", "y", 0.0, 1.0)
    trace = json.load(open(off.dump(tmp_path / "off.json")))
    assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == []
    assert validate_trace(trace) == []


def test_record_function_labels_on_cpu():
    torch = pytest.importorskip("torch")
    rec = TraceRecorder(0, record_function=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with rec.span("compute", "attn.core"):
            torch.ones(4) + 1
    assert "attn.core" in {e.key for e in prof.key_averages()}


def test_executor_ops_are_profiler_ranges():
    """Every compute span of an SI step (forward ops, backward ops, deferred weight-gradient
    passes) is also a ``torch.profiler`` range of the same name: on CUDA the profiler then
    attributes kernels to the trace's op names."""
    torch = pytest.importorskip("torch")
    from ds_dhelix.runtime.executor import Executor
    from hf_models.adapters import adapter_for
    from tests.conftest import make_batches, make_config, make_model

    config = make_config("tiny-llama")
    model = make_model(config)
    rec = TraceRecorder(0, record_function=True)
    executor = Executor(adapter_for(config).build_graph(model), None, recorder=rec, defer_weight_grads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        executor.run_microbatches(list(make_batches(config.vocab_size, 4)), "si", 0.25)
    spans = {e["name"] for e in rec.events() if e["ph"] == "X"}
    assert any(name.endswith(".wgrad") for name in spans)
    assert spans - {e.key for e in prof.key_averages()} == set()


def test_merge_traces(tmp_path):
    paths = [_recorder(r).dump(tmp_path / f"rank{r}.json") for r in range(2)]
    merged = merge_traces(paths, tmp_path / "merged.json")
    assert json.load(open(tmp_path / "merged.json")) == merged
    assert validate_trace(merged, lanes=("compute", "comm:tp")) == []
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}
    with pytest.raises(ValueError, match="rank"):
        merge_traces([paths[0], paths[0]], tmp_path / "bad.json")
