"""Golden losses (``tests/golden/losses.json``, written by ``python -m scripts.update_golden``): every
tiny preset trained for 3 steps sequentially and with SI (fp32, CPU gloo, fixed seed and data) must
reproduce the file.

Tolerance GOLDEN_ATOL on losses of ~7.6: the same torch release on another CPU may run fp32
matmuls with other vector kernels (AVX2 vs AVX-512), which reorders sums at the level of 1e-6
relative; a change to the math (a dropped op, a wrong scale, other data or optimizer settings)
moves these losses by 1e-3 or more. SI and sequential are also compared with each other: bitwise.
"""

from __future__ import annotations

import json

import pytest

from scripts.update_golden import GOLDEN_PATH, LAYOUTS, run_golden

GOLDEN_ATOL = 1e-4


@pytest.fixture(scope="module")
def measured():
    return run_golden(timeout=500)


def test_golden_file_covers_every_preset():
    from hf_models.registry import PRESETS

    with open(GOLDEN_PATH) as f:
        golden = json.load(f)["losses"]
    assert set(golden) == set(LAYOUTS) == {p for p in PRESETS if p.startswith("tiny-")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", sorted(LAYOUTS))
def test_losses_match_the_golden_file(measured, preset):
    with open(GOLDEN_PATH) as f:
        golden = json.load(f)["losses"][preset]
    got = measured[preset]
    assert got["si"] == got["sequential"], "SI and sequential must agree bitwise"
    for schedule in ("sequential", "si"):
        assert len(got[schedule]) == len(golden[schedule]) == 3
        for step, (a, b) in enumerate(zip(got[schedule], golden[schedule])):
            assert abs(a - b) <= GOLDEN_ATOL, f"{schedule} step {step}: {a} vs golden {b}"
