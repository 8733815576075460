"""The DeepSpeed settings read once (``ds_dhelix.config.ds_settings``): what the typed view parses,
how a value DeepSpeed's models refuse is said, and that below the builder no function of the engine
takes the raw ds_config."""

from __future__ import annotations

import ast
import pathlib

import pytest

from ds_dhelix.config.ds_settings import DeepSpeedSettings, ZeroSettings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_view_holds_what_the_checks_read():
    ds = DeepSpeedSettings.from_ds_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0,
            "bfloat16": {"enabled": True},  # DeepSpeed's old spelling counts as DeepSpeed counts it
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupLR", "params": {}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "reduce_bucket_size": 1000,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 1,  # 1 is off
            },
            "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
            "data_types": {"grad_accum_dtype": "bfloat16"},
        }
    )
    assert (ds.half, ds.bf16, ds.fp16, ds.gradient_clipping, ds.micro_batch_size) == ("bf16", True, False, 1.0, 2)
    assert (ds.optimizer, ds.has_optimizer, ds.scheduler) == ("AdamW", True, "WarmupLR")
    assert ds.checkpointing_on == ("cpu_checkpointing",) and ds.grad_accum_matches
    z = ds.zero
    assert (z.stage, z.offload_param, z.offload_optimizer, z.reduce_bucket_size) == (3, "cpu", "none", 1000)
    assert z.zeropp_on == ("zero_quantized_gradients",) and z.written["zero_hpz_partition_size"] == 1
    plain = DeepSpeedSettings.from_ds_config({"train_batch_size": 4})
    assert (plain.half, plain.zero.stage, plain.zero.reduce_bucket_size, plain.has_optimizer) == (None, 0, None, False)
    assert not DeepSpeedSettings.from_ds_config(
        {"data_types": {"grad_accum_dtype": "fp32"}, "fp16": {"enabled": True}}
    ).grad_accum_matches


def test_auto_values_are_left_to_the_trainer():
    """HF's "auto" placeholders are filled by the Trainer before the engine is built; read before
    that, they are not a setting (DeepSpeed's models drop them the same way)."""
    ds = DeepSpeedSettings.from_ds_config({"fp16": {"enabled": "auto"}, "gradient_clipping": "auto"})
    assert not ds.fp16 and ds.half is None


@pytest.mark.parametrize(
    "config, words",
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, ["zero_optimization.reduce_bucket_size"]),
        ({"fp16": {"enabled": True, "loss_scale": -2}}, ["fp16", "loss_scale must be >= 0"]),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, ["zero_optimization.offload_param"]),
        ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage = 4", "use 0, 1, 2 or 3"]),
        ({"bf16": True}, ['"bf16" must be a JSON object']),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping must be a number", "'1.0'"]),
    ],
)
def test_a_value_deepspeed_refuses_is_one_line_naming_the_key(config, words):
    with pytest.raises(ValueError) as err:
        DeepSpeedSettings.from_ds_config(config)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_zero_settings_of_an_absent_section_are_stage_0():
    assert ZeroSettings.parse(None) == ZeroSettings.parse({}) and ZeroSettings.parse(None).stage == 0


def test_below_the_builder_no_engine_function_takes_the_raw_ds_config():
    """Only the entry points (``check_setup``, ``build_engine`` / ``initialize``'s ``config``, the
    Trainer's own reading of what the user wrote) and ``deepspeed_view`` (which writes DeepSpeed's
    copy) take the dict; every other function reads ``Setup.ds`` / ``DhelixConfig``."""
    allowed = {
        ("build.py", "check_setup"),
        ("build.py", "build_engine"),
        ("build.py", "initialize"),
        ("build.py", "deepspeed_view"),
        ("trainer.py", "_config_for_check"),
        ("guard.py", "enabled_dhelix_section"),
        ("checkpoint.py", "_fill_special_ids"),  # a model / generation config, not a ds_config
    }
    found = set()
    for path in sorted((ROOT / "ds_dhelix" / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if names & {"ds_config", "config"}:
                    found.add((path.name, node.name))
    assert found - allowed == set(), sorted(found - allowed)


@pytest.mark.parametrize(
    "layout, words",
    [
        (dict(optimizer="Muon", tp=2), ['"type": "Muon"', "tensor_parallel.size = 2", "use tensor_parallel.size 1"]),
        (dict(optimizer="Muon", tp=1, dp=2, zero_stage=3), ["zero_optimization.stage = 3", "use stage 1 or 2"]),
        # found by the strength-3 feature matrix: SI differs from sequential by rounding with Muon under CP
        (dict(optimizer="Muon", tp=1, cp=2), ["context_parallel.size = 2", "not supported yet", "AdamW with CP"]),
        (dict(optimizer="Lion", tp=1, dp=2), ['"type": "Lion"', "FusedLion", 'offload_optimizer.device to "cpu"']),
    ],
)
def test_an_optimizer_that_cannot_run_so_is_refused_before_any_model(layout, words):
    from ds_dhelix.engine.build import check_setup
    from ds_dhelix.verify.options import ParityOptions
    from hf_models.registry import load_config

    opts = ParityOptions(**layout)
    with pytest.raises(ValueError) as err:
        check_setup(opts.ds_config("si"), load_config("tiny-llama"), opts.world)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text
    offloaded = ParityOptions(optimizer="Lion", tp=1, dp=2, zero={"offload_optimizer": {"device": "cpu"}})
    check_setup(offloaded.ds_config("si"), load_config("tiny-llama"), offloaded.world)  # DeepSpeedCPULion
