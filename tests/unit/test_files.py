"""The shared-filesystem mode (fastcifar/sweep/files.py): fixed shares, the spec made by the first task
and checked by the others, result files whole or absent, and their merge into the table and arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fastcifar
from fastcifar.core.config import ConfigError
from fastcifar.sweep import files
from fastcifar.sweep import spec as specs
from fastcifar.sweep.store import Result

DOC = {
    "preset": "fast",
    "seed": 2,
    "runs": 3,
    "keep": ["test_margins", "train_margins"],
    "settings": {"data": "data", "widths": [16, 32, 32], "epochs": 1},
    "axes": {"lr": [0.2, 0.4]},
}


def spec_of(**changes):
    return specs.parse({**DOC, **changes}, "spec.json", ".")


def result(idx: int) -> Result:
    rng = np.random.default_rng(idx)
    return Result(
        rng.random(30) < 0.5, 10, 40.0 + idx, 1.0, 0.5, 2.0, idx < 2, f"runs/{idx}/r",
        test_margins=rng.normal(size=8).astype(np.float32), train_margins=rng.normal(size=30).astype(np.float32),
        started=1000.0 + 60 * idx, ended=1060.0 + 60 * idx,
    )  # fmt: skip


def test_the_shares_cover_every_run_once_and_number_runs_as_the_table_does():
    spec = spec_of()
    shares = [files.share(spec, i, 4) for i in range(4)]
    assert shares == [[0, 4], [1, 5], [2], [3]]
    assert files.row_of(spec, 5) == {"idx": 5, "arm": 1, "rep": 2, "seed": 4}
    assert files.share(spec, 0, 10) == [0] and files.share(spec, 7, 10) == []  # more workers than runs


def test_the_first_task_writes_the_spec_and_the_others_check_it(tmp_path):
    folder = files.prepare_files(str(tmp_path / "s"), spec_of())
    text = (folder / "spec.json").read_text()
    assert files.prepare_files(str(folder), spec_of()) == folder and (folder / "spec.json").read_text() == text
    with pytest.raises(ConfigError, match="its spec differs in settings.epochs"):
        files.prepare_files(str(folder), spec_of(settings={**DOC["settings"], "epochs": 2}))
    with pytest.raises(ConfigError, match="a spec may add runs, not drop them"):
        files.prepare_files(str(folder), spec_of(runs=2))
    files.prepare_files(str(folder), spec_of(runs=4))
    assert json.loads((folder / "spec.json").read_text())["runs"] == 4


def test_a_result_file_holds_the_run_and_merges_into_the_table_and_arrays(tmp_path):
    spec = spec_of()
    folder = files.prepare_files(str(tmp_path / "s"), spec)
    for idx in (0, 3, 4):
        files.save_result(folder, idx, result(idx), "host:1:0")
    files.save_failure(folder, 5, "ConfigError: no data", "host:2:0")
    back = files.load_result(files.result_file(folder, 3))
    np.testing.assert_array_equal(back.test_margins, result(3).test_margins)
    assert back.test_logits is None and back.test_acc == 43.0 and back.run_dir == "runs/3/r"
    assert files.counts(folder, spec) == {"done": 3, "failed": 1, "running": 0, "pending": 2}
    assert not list((folder / "results").glob("*.tmp*"))
    assert files.merge(folder) == 4
    view = fastcifar.open_store(str(folder))
    assert view.completed.tolist() == [True, False, False, True, True, False]
    np.testing.assert_array_equal(view.train_margins[4], result(4).train_margins.astype(np.float16))
    np.testing.assert_array_equal(view.masks[3], result(3).mask)
    assert [r["status"] for r in view.runs] == ["done", "pending", "pending", "done", "done", "failed"]
    assert view.runs[5]["reason"] == "ConfigError: no data" and view.runs[0]["test_acc"] == 40.0
    assert (view.runs[4]["started"], view.runs[4]["ended"]) == (1240.0, 1300.0)  # the run's own times
    files.save_result(folder, 1, result(1), "host:1:0")
    assert files.merge(folder) == 1  # only what is new
    assert fastcifar.open_store(str(folder)).completed.tolist()[:2] == [True, True]


def test_a_share_is_i_of_n():
    assert files.worker_share("2/4") == (2, 4)
    for bad in ("4/4", "-1/3", "x", "1/0"):
        with pytest.raises(ConfigError):
            files.worker_share(bad)
