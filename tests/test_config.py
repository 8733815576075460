"""Config tier: every bad key, type and value of the "dhelix" section raises ValueError naming it."""

import dataclasses
import json

import pytest

from ds_dhelix.config.section import (
    BatchSizes,
    DhelixConfig,
    PipelineConfig,
    TensorParallelConfig,
    derive_batch,
    load_ds_config,
)


def parse(section):
    return DhelixConfig.from_ds_config({"dhelix": section})


# ---------------------------------------------------------------- defaults and round trip


def test_absent_section_gives_disabled_defaults():
    cfg = DhelixConfig.from_ds_config({"train_batch_size": 8})
    assert cfg == DhelixConfig()
    assert cfg.enabled is False and cfg.schedule == "si"
    assert cfg.tensor_parallel.size == 1 and cfg.tensor_parallel.sequence_parallel is True
    assert cfg.expert_parallel.capacity_factor is None and cfg.expert_parallel.aux_loss_coef is None
    assert cfg.pipeline.stages == 1 and cfg.pipeline.split is None
    assert cfg.planner.profile == "off" and cfg.planner.table_path is None
    assert (cfg.planner.warmup, cfg.planner.repeats) == (2, 5)
    assert cfg.trace == dataclasses.replace(cfg.trace, enabled=False, path="runs/trace.json", steps=3)
    assert cfg.benchmark.link_gbps is None
    assert cfg.watchdog_s == 600.0 and cfg.log_interval == 1
    assert parse({}) == cfg and parse(None) == cfg


def test_round_trip_through_json(tmp_path):
    table = tmp_path / "table.json"
    table.write_text("{}")
    section = {
        "enabled": True,
        "schedule": "w",
        "si_execution": "plan",
        "defer_weight_grads": False,
        "tensor_parallel": {"size": 2, "sequence_parallel": True},
        "expert_parallel": {"size": 2, "capacity_factor": 1.25, "aux_loss_coef": 0.02},
        "pipeline": {"stages": 2, "split": [1, 2, 2, 1]},
        "planner": {"profile": str(table), "cache_dir": str(tmp_path), "warmup": 0, "repeats": 1},
        "trace": {"enabled": True, "path": "t.json", "steps": 1},
        "benchmark": {"link_gbps": 2},
        "watchdog_s": 30,
        "log_interval": 10,
    }
    cfg = parse(section)
    assert cfg.pipeline.split == (1, 2, 2, 1)
    assert cfg.benchmark.link_gbps == 2.0 and isinstance(cfg.benchmark.link_gbps, float)
    assert cfg.watchdog_s == 30.0 and isinstance(cfg.watchdog_s, float)
    assert cfg.planner.table_path == str(table)
    dumped = json.loads(json.dumps(cfg.to_dict()))
    assert DhelixConfig.from_dict(dumped) == cfg
    assert dumped["pipeline"]["split"] == [1, 2, 2, 1]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DhelixConfig().enabled = True


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match=r"dhelix\.tensor_parallel\.size"):
        TensorParallelConfig(size=0)
    with pytest.raises(ValueError, match=r"dhelix\.pipeline\.split"):
        PipelineConfig(stages=2, split=(1, 0))


# ---------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "section, path, suggestion",
    [
        ({"enabeld": True}, "dhelix.enabeld", "enabled"),
        ({"tensor_parallel": {"szie": 2}}, "dhelix.tensor_parallel.szie", "size"),
        ({"expert_parallel": {"capacity": 1.0}}, "dhelix.expert_parallel.capacity", "capacity_factor"),
        ({"pipeline": {"stage": 2}}, "dhelix.pipeline.stage", "stages"),
        ({"planner": {"repeat": 3}}, "dhelix.planner.repeat", "repeats"),
        ({"trace": {"paht": "x"}}, "dhelix.trace.paht", "path"),
        ({"benchmark": {"link_gbit": 1}}, "dhelix.benchmark.link_gbit", "link_gbps"),
    ],
)
def test_unknown_key_names_path_valid_keys_and_suggestion(section, path, suggestion):
    with pytest.raises(ValueError) as e:
        parse(section)
    msg = str(e.value)
    assert f"'{path}'" in msg
    assert "valid keys" in msg and suggestion in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ValueError, match=r"'dhelix\.zzz'.*valid keys in 'dhelix': enabled, schedule"):
        parse({"zzz": 1})


# ---------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    "section, path",
    [
        ({"enabled": 1}, "dhelix.enabled"),
        ({"enabled": "true"}, "dhelix.enabled"),
        ({"schedule": 2}, "dhelix.schedule"),
        ({"tensor_parallel": 2}, "dhelix.tensor_parallel"),
        ({"tensor_parallel": {"size": True}}, "dhelix.tensor_parallel.size"),
        ({"tensor_parallel": {"size": "2"}}, "dhelix.tensor_parallel.size"),
        ({"tensor_parallel": {"size": 2.0}}, "dhelix.tensor_parallel.size"),
        ({"tensor_parallel": {"sequence_parallel": 0}}, "dhelix.tensor_parallel.sequence_parallel"),
        ({"expert_parallel": {"size": False}}, "dhelix.expert_parallel.size"),
        ({"expert_parallel": {"capacity_factor": "1.0"}}, "dhelix.expert_parallel.capacity_factor"),
        ({"expert_parallel": {"aux_loss_coef": True}}, "dhelix.expert_parallel.aux_loss_coef"),
        ({"pipeline": {"stages": 1.5}}, "dhelix.pipeline.stages"),
        ({"pipeline": {"split": "1,1"}}, "dhelix.pipeline.split"),
        ({"pipeline": {"split": [1, True]}}, "dhelix.pipeline.split"),
        ({"pipeline": {"split": [1.0]}}, "dhelix.pipeline.split"),
        ({"planner": {"profile": None}}, "dhelix.planner.profile"),
        ({"planner": {"cache_dir": 3}}, "dhelix.planner.cache_dir"),
        ({"planner": {"warmup": "2"}}, "dhelix.planner.warmup"),
        ({"planner": {"repeats": True}}, "dhelix.planner.repeats"),
        ({"trace": {"enabled": "yes"}}, "dhelix.trace.enabled"),
        ({"trace": {"path": ["a"]}}, "dhelix.trace.path"),
        ({"trace": {"steps": 3.0}}, "dhelix.trace.steps"),
        ({"benchmark": {"link_gbps": "fast"}}, "dhelix.benchmark.link_gbps"),
        ({"benchmark": []}, "dhelix.benchmark"),
        ({"watchdog_s": "600"}, "dhelix.watchdog_s"),
        ({"watchdog_s": True}, "dhelix.watchdog_s"),
        ({"log_interval": 1.0}, "dhelix.log_interval"),
        ({"seed": "1234"}, "dhelix.seed"),
        ({"seed": 1.0}, "dhelix.seed"),
    ],
)
def test_wrong_type_names_field_and_value(section, path):
    with pytest.raises(ValueError) as e:
        parse(section)
    msg = str(e.value)
    assert msg.startswith(path + " must be ") or msg.startswith(f"'{path}' must be"), msg
    assert "got" in msg


def test_section_must_be_object():
    with pytest.raises(ValueError, match=r"'dhelix' must be a JSON object"):
        DhelixConfig.from_ds_config({"dhelix": [1]})
    with pytest.raises(ValueError, match="ds_config must be a dict"):
        DhelixConfig.from_ds_config("ds_config.json")


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "section, path, expect",
    [
        (
            {"schedule": "dualpipe"},
            "dhelix.schedule",
            "sequential, si, intra, auto, w, dualpipev; did you mean 'dualpipev'",
        ),
        ({"schedule": "1f1b"}, "dhelix.schedule", "sequential, si, intra, auto, w, dualpipev"),
        (
            {"si_execution": "streaming"},
            "dhelix.si_execution",
            "reactive, plan; did you mean 'reactive'? (formerly 'stream')",
        ),
        ({"si_execution": "reactiv"}, "dhelix.si_execution", "did you mean 'reactive'?"),
        ({"planner": {"profile": "auto"}}, "dhelix.planner.profile", "needs dhelix.si_execution = 'plan'"),
        ({"pair_ends": True, "si_execution": "plan"}, "dhelix.pair_ends", "si_execution 'plan'"),
        ({"pair_ends": True, "schedule": "w"}, "dhelix.pair_ends", "schedule 'w'"),
        ({"tensor_parallel": {"size": 0}}, "dhelix.tensor_parallel.size", ">= 1"),
        ({"expert_parallel": {"size": -2}}, "dhelix.expert_parallel.size", ">= 1"),
        ({"expert_parallel": {"capacity_factor": 0}}, "dhelix.expert_parallel.capacity_factor", "> 0"),
        ({"expert_parallel": {"aux_loss_coef": -0.1}}, "dhelix.expert_parallel.aux_loss_coef", ">= 0"),
        ({"pipeline": {"stages": 0}}, "dhelix.pipeline.stages", ">= 1"),
        ({"pipeline": {"split": [2, 0]}, "schedule": "sequential"}, "dhelix.pipeline.split", "at least 1 layer"),
        ({"pipeline": {"split": []}}, "dhelix.pipeline.split", "at least 1 layer"),
        ({"planner": {"profile": "atuo"}}, "dhelix.planner.profile", "did you mean 'auto'"),
        ({"planner": {"profile": "/no/such/table.json"}}, "dhelix.planner.profile", "existing table JSON"),
        ({"planner": {"cache_dir": ""}}, "dhelix.planner.cache_dir", "non-empty"),
        ({"planner": {"warmup": -1}}, "dhelix.planner.warmup", ">= 0"),
        ({"planner": {"repeats": 0}}, "dhelix.planner.repeats", ">= 1"),
        ({"trace": {"path": ""}}, "dhelix.trace.path", "non-empty"),
        ({"trace": {"steps": 0}}, "dhelix.trace.steps", ">= 1"),
        ({"benchmark": {"link_gbps": 0}}, "dhelix.benchmark.link_gbps", "> 0"),
        ({"watchdog_s": 0}, "dhelix.watchdog_s", "> 0"),
        ({"log_interval": 0}, "dhelix.log_interval", ">= 1"),
    ],
)
def test_bad_value_names_field_value_and_choices(section, path, expect):
    with pytest.raises(ValueError) as e:
        parse(section)
    msg = str(e.value)
    assert msg.startswith(path + " = "), msg
    assert expect in msg


@pytest.mark.parametrize(
    "schedule, stages, split, needed",
    [("w", 2, [2, 2], 4), ("dualpipev", 3, [4], 6), ("sequential", 2, [2, 2], 4), ("auto", 2, [1, 1, 2], 4)],
)
def test_split_length_must_match_chunks(schedule, stages, split, needed):
    # every pipeline schedule runs on the fold: 2 x stages chunks, the sequential fold too
    with pytest.raises(ValueError, match=rf"dhelix\.pipeline\.split = .* into {needed} chunks"):
        parse({"schedule": schedule, "pipeline": {"stages": stages, "split": split}})


@pytest.mark.parametrize("schedule", ["si", "dualpipev"])
def test_split_without_a_pipeline_is_refused(schedule):
    with pytest.raises(ValueError, match=r"dhelix\.pipeline\.split = \[1, 3\] with stages = 1"):
        parse({"schedule": schedule, "pipeline": {"stages": 1, "split": [1, 3]}})


@pytest.mark.parametrize("schedule", ["w", "sequential"])
def test_valid_split_for_a_pipeline(schedule):
    cfg = parse({"schedule": schedule, "pipeline": {"stages": 2, "split": [1, 1, 1, 1]}})
    assert cfg.pipeline.num_chunks() == 4


# ---------------------------------------------------------------- batch arithmetic


def test_batch_mismatch_message_has_the_numbers():
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError) as e:
        derive_batch(ds, world_size=4, tp=2, pp=1, ep=1)
    msg = str(e.value)
    assert "train_batch_size 8 != micro 2 x accumulation 1 x data-parallel size 2 (world 4 / tp 2 / pp 1)" in msg
    assert "train_batch_size to 4" in msg and "gradient_accumulation_steps to 2" in msg


@pytest.mark.parametrize(
    "ds, world, tp, pp, ep, expect",
    [
        ({"train_batch_size": 16}, 4, 1, 1, 1, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 2}, 4, 2, 1, 1, (4, 2, 1)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 8, 2, 2, 1, (12, 2, 3)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, 4, 1, 2, 1, (24, 2, 6)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 8, 2, 1, 2, (32, 2, 4)),
        (
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            2,
            1,
            1,
            1,
            (8, 2, 2),
        ),
    ],
)
def test_batch_filled_like_deepspeed(ds, world, tp, pp, ep, expect):
    layout = derive_batch(ds, world, tp, pp, ep)
    assert isinstance(layout, BatchSizes)
    assert (layout.train_batch_size, layout.micro_batch_size, layout.gradient_accumulation_steps) == expect
    assert layout.data_parallel_size == world // (tp * pp)
    assert layout.dims.edp == world // (tp * pp * ep)


def test_expert_parallel_does_not_change_dp_size():
    layout = derive_batch({"train_micro_batch_size_per_gpu": 1}, world_size=8, tp=1, pp=1, ep=4)
    assert layout.data_parallel_size == 8 and layout.dims.edp == 2
    assert layout.train_batch_size == 8
    table = layout.table()
    assert "data parallel (dp)" in table and "world / (tp x pp)" in table and "expert data parallel" in table


def test_sizes_default_to_the_dhelix_section():
    ds = {"train_micro_batch_size_per_gpu": 1, "dhelix": {"tensor_parallel": {"size": 2}, "pipeline": {"stages": 2}}}
    assert derive_batch(ds, world_size=8).data_parallel_size == 2


def test_world_not_divisible_lists_choices():
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by tensor_parallel.size 4 x pipeline.stages 1 = 4.*\[1, 2, 3, 6\]",
    ):
        derive_batch({"train_batch_size": 6}, 6, 4, 1, 1)


def test_ep_must_divide_dp():
    with pytest.raises(
        ValueError, match=r"expert_parallel.size 3 .* data-parallel size 4 .*valid ep sizes: \[1, 2, 4\]"
    ):
        derive_batch({"train_batch_size": 8}, 4, 1, 1, 3)


@pytest.mark.parametrize(
    "ds, match",
    [
        ({}, "set train_batch_size or train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": 2}, "set train_batch_size or train_micro_batch_size_per_gpu"),
        (
            {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4},
            r"train_batch_size 6 is not a multiple of micro 4 x data-parallel size 2.*multiple of 8",
        ),
        (
            {"train_batch_size": 6, "gradient_accumulation_steps": 4},
            r"train_batch_size 6 is not a multiple of accumulation 4 x data-parallel size 2",
        ),
        ({"train_batch_size": "auto"}, "train_batch_size must be a positive integer, got 'auto'"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a positive integer"),
    ],
)
def test_batch_errors(ds, match):
    with pytest.raises(ValueError, match=match):
        derive_batch(ds, 2, 1, 1, 1)


def test_ep_named_in_mismatch_message():
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match=r"data-parallel size 4 \(world 4 / tp 1 / pp 1; ep 2 does not change it\)"):
        derive_batch(ds, 4, 1, 1, 2)


# ---------------------------------------------------------------- file loading


def test_load_ds_config(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 4, "dhelix": {"enabled": True}}))
    assert DhelixConfig.from_ds_config(load_ds_config(good)).enabled

    with pytest.raises(ValueError, match="not found"):
        load_ds_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="is a directory"):
        load_ds_config(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 4,\n}\n')
    with pytest.raises(ValueError, match=r"not valid JSON: .* at line 3 column 1") as e:
        load_ds_config(bad)
    assert "\n" not in str(e.value)
    arr = tmp_path / "arr.json"
    arr.write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_ds_config(arr)


def test_old_si_execution_name_still_works_with_a_warning():
    with pytest.warns(FutureWarning, match="'stream' is deprecated.*use 'reactive'"):
        cfg = DhelixConfig.from_ds_config({"dhelix": {"enabled": True, "si_execution": "stream"}})
    assert cfg.si_execution == "reactive"
    assert DhelixConfig.from_dict(cfg.to_dict()) == cfg  # round trip writes the new name
