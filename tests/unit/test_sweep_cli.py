"""``fastcifar sweep`` (fastcifar/sweep/cli.py): bad input is one line and exit 2 before any worker
starts; status and compare read a store; the progress line. The studies themselves:
tests/acceptance/test_sweeps.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import one_line_error

from fastcifar import cli
from fastcifar.core.config import ConfigError
from fastcifar.sweep import cli as sweep_cli
from fastcifar.sweep import spec as specs
from fastcifar.sweep import store as stores
from fastcifar.sweep.store import Result, Table

DOC = {
    "preset": "fast",
    "seed": 0,
    "runs": 2,
    "settings": {"data": "data", "widths": [16, 32, 32], "epochs": 1},
    "axes": {"label_smoothing": [0.0, 0.2]},
}


def write_spec(tmp_path, **changes):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**DOC, **changes}))
    return path


@pytest.mark.parametrize(
    "args, says",
    [
        (["--per-device", "0"], "--per-device must be 1 or more, not 0"),
        (["--devices", "x,y"], "--devices takes all, cpu or GPU numbers"),
        (["--devices", "7"], "--devices 7: this machine has"),
        (["--lease-s", "0"], "--lease-s must be positive"),
    ],
)
def test_bad_options_are_one_line_and_nothing_is_made(tmp_path, capsys, args, says):
    spec = write_spec(tmp_path)
    assert cli.main(["sweep", str(spec), "--store", str(tmp_path / "store"), *args]) == 2
    assert says in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "store").exists()


def test_a_bad_spec_is_one_line_and_nothing_is_made(tmp_path, capsys):
    spec = write_spec(tmp_path, runs=0)
    assert cli.main(["sweep", str(spec), "--store", str(tmp_path / "store"), "--devices", "cpu"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error: ") and "runs must be a whole number" in line
    assert not (tmp_path / "store").exists()


def test_a_store_that_cannot_be_made_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    spec = write_spec(tmp_path)
    assert cli.main(["sweep", str(spec), "--store", str(tmp_path / "file"), "--devices", "cpu"]) == 2
    assert "--store" in one_line_error(capsys.readouterr().err)


def test_the_devices(monkeypatch):
    import torch

    assert sweep_cli.parse_devices("cpu") == [("cpu", None)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert sweep_cli.parse_devices("all") == [("cpu", None)]  # no GPU: the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert sweep_cli.parse_devices("all") == [("cuda", "0"), ("cuda", "1"), ("cuda", "2")]
    assert sweep_cli.parse_devices("2,0") == [("cuda", "2"), ("cuda", "0")]
    with pytest.raises(ConfigError, match="each named once"):
        sweep_cli.parse_devices("1,1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")  # a scheduler's GPUs: each worker is given one of them
    assert sweep_cli.parse_devices("1") == [("cuda", "5")]


def finished_store(tmp_path):
    spec = specs.parse(DOC, "spec.json", ".")
    folder = stores.prepare(str(tmp_path / "store"), spec)
    table = Table(folder)
    for acc in (90.0, 91.0, 92.0, 92.5):
        row = table.claim("w", 60)
        r = Result(np.ones(20, bool), 10, acc, 1.0, 0.5, 2.0, row["idx"] == 0, f"runs/{row['idx']}/x")
        r.test_margins = np.zeros(5, np.float32)
        assert table.finish(row["idx"], "w", r, spec.keep)
    return folder


def test_status_and_compare_read_a_store(tmp_path, capsys):
    folder = finished_store(tmp_path)
    assert cli.main(["sweep", "status", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("4/4 done, 0 failed, 0 running, 0 pending; ") and out[0].endswith(" models/h")
    assert out[2].split()[:4] == ["label_smoothing=0.0", "2", "0", "0"] and "91.00% ± 1.41" in out[2]
    assert cli.main(["sweep", "compare", str(folder), "label_smoothing=0.2", "label_smoothing=0.0"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("label_smoothing=0.2 - label_smoothing=0.0: +0.750 points") and "over 2 paired runs" in line


def test_a_finished_study_run_again_says_so_and_starts_no_worker(tmp_path, capsys):
    folder = finished_store(tmp_path)
    spec = write_spec(tmp_path)
    assert cli.main(["sweep", str(spec), "--store", str(folder), "--devices", "cpu"]) == 0
    assert "all 4 runs" in capsys.readouterr().out
    assert not (folder / "logs").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["status", "NOSTORE"], "is not a sweep store"),
        (["compare", "STORE", "label_smoothing=0.5", "0"], "no arm 'label_smoothing=0.5'"),
        (["compare", "STORE", "0"], "the following arguments are required: arm_b"),
    ],
)
def test_status_and_compare_refuse_in_one_line(tmp_path, capsys, argv, says):
    folder = finished_store(tmp_path)
    argv = [a.replace("NOSTORE", str(tmp_path)).replace("STORE", str(folder)) for a in argv]
    try:
        code = cli.main(["sweep", *argv])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    assert says in one_line_error(capsys.readouterr().err)


def test_the_progress_line_without_a_terminal(capsys):
    line = sweep_cli.Line(total=10, done_before=2)
    line.show({"done": 2, "failed": 0, "pending": 8, "running": 0})
    line.start -= 3600  # an hour in: 4 more finished
    line.show({"done": 5, "failed": 1, "pending": 4, "running": 0})
    line.show({"done": 5, "failed": 1, "pending": 3, "running": 1})  # nothing finished: no new line
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "sweep: 2 done, 0 failed of 10; 0 models/h; ETA ?",
        "sweep: 5 done, 1 failed of 10; 4 models/h; ETA 3600 s",
    ]


def test_masks_of_the_wrong_length_for_the_data_are_one_line_before_any_worker(tmp_path, official_dir, capsys):
    data, arrays = official_dir
    np.save(tmp_path / "masks.npy", np.ones((2, len(arrays["train"][1]) + 1), bool))
    settings = {**DOC["settings"], "data": str(data)}
    spec = write_spec(tmp_path, settings=settings, subset={"policy": "masks", "masks": "masks.npy"})
    assert cli.main(["sweep", str(spec), "--store", str(tmp_path / "store"), "--devices", "cpu"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "rows of 201 images, but the data has 200 training images" in line
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--worker", "1"], {}, "--worker I and --workers N go together"),
        (["--worker", "4", "--workers", "4"], {}, "the index must lie in 0..N-1"),
        (
            [],
            {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "4"},
            "SLURM_ARRAY_TASK_ID 9 (from 0) is not one of",
        ),
    ],
)
def test_a_bad_worker_index_is_one_line(tmp_path, capsys, monkeypatch, args, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = write_spec(tmp_path)
    assert cli.main(["sweep", str(spec), "--store", str(tmp_path / "store"), "--devices", "cpu", *args]) == 2
    assert says in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "store").exists()


def test_a_share_with_nothing_left_says_so(tmp_path, capsys):
    spec = write_spec(tmp_path)
    args = ["sweep", str(spec), "--store", str(tmp_path / "store"), "--devices", "cpu", "--worker", "5"]
    assert cli.main([*args, "--workers", "6"]) == 0  # 4 runs: worker 5 of 6 has none
    out = capsys.readouterr().out
    assert out == "sweep: worker 5 of 6: each of its 0 runs of 4 has its result file\n"


def test_array_tasks_refuse_a_store_of_the_shared_table(tmp_path, capsys):
    folder = finished_store(tmp_path)
    spec = write_spec(tmp_path)
    args = ["sweep", str(spec), "--store", str(folder), "--devices", "cpu", "--worker", "0", "--workers", "2"]
    assert cli.main(args) == 2
    assert "was made by workers sharing its run table" in one_line_error(capsys.readouterr().err)


def test_a_study_begun_as_array_tasks_counts_their_result_files_on_one_machine(tmp_path, capsys):
    from fastcifar.sweep import files

    spec = specs.parse(DOC, "spec.json", ".")
    folder = files.prepare_files(str(tmp_path / "store"), spec)
    for idx, acc in enumerate((90.0, 91.0, 92.0, 92.5)):
        r = Result(np.ones(20, bool), 10, acc, 1.0, 0.5, 2.0, True, f"runs/{idx}/x")
        r.test_margins = np.zeros(5, np.float32)
        files.save_result(folder, idx, r, "host:1:0")
    assert cli.main(["sweep", str(write_spec(tmp_path)), "--store", str(folder), "--devices", "cpu"]) == 0
    assert "all 4 runs" in capsys.readouterr().out  # merged, none trained again
    assert not (folder / "logs").exists()
