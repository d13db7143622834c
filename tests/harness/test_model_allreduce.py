"""bench/model_allreduce.py: the arithmetic of the 8-GPU model, and the committed table is what the
script makes from today's plan and rows (rerun it after changing either)."""

from __future__ import annotations

import pytest
from cli import ROOT
from script_modules import load_script


@pytest.fixture(scope="module")
def model():
    return load_script("bench/model_allreduce.py", register=True)  # its dataclasses look their module up there


def test_model_ring_time_and_exposure_arithmetic(model):
    m = model.Machine("test", 8, busbw_gbs=400.0, alpha_us=20.0, link="", step_rule="")
    # 8 MB over 8 ranks: 2 x 7/8 x 8e6 B / 400 GB/s = 35 us, plus 20 us
    assert model.ring_ms(8e6, 8, 400.0, 20.0) == pytest.approx(0.055)
    one = model.ring_ms(1e6, 8, 400.0, 20.0)
    assert model.exposed_ms([(1e6, 0.1)], 1.0, 8, m) == 0.0, "done long before backward ends"
    assert model.exposed_ms([(1e6, 1.0)], 1.0, 8, m) == pytest.approx(one), "ready at the end: all exposed"
    # two buckets ready at 0.99 ms queue on one stream: the second ends at 0.99 + 2 x its time
    assert model.exposed_ms([(1e6, 0.99), (1e6, 0.99)], 1.0, 8, m) == pytest.approx(0.99 + 2 * one - 1.0)


def test_model_table_names_the_default_preset_and_is_current(model):
    text = model.build()
    assert "`fast-jitter`" in text and "1,971,352 trainable parameters" in text and "3.94 MB of fp16" in text
    for machine in model.MACHINES:
        assert f"| {machine.name} |" in text
    assert "1.576 MB at 1.00" in text, "the plan before issue 73: its largest bucket last"
    assert "0.102 MB at 1.00" in text, "after: the last bucket small"
    assert (ROOT / "bench" / "results" / "allreduce_model_8gpu.md").read_text() == text, (
        "bench/results/allreduce_model_8gpu.md is stale: rerun python bench/model_allreduce.py"
    )
