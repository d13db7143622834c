"""scripts/race.py: the figures the race reports (its t-test: tests/unit/test_stats.py), each public
script's printed results (captured lines in race_logs/: hiverge's from its published log of 06c6072
with a cut-off row appended, the airbench scripts' printed by their own logging functions), the
edits it may make to a public script, and its table and jsonl rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

from fastcifar.core.stats import t_sf
from fastcifar.run.report import EpochRecord, RunResult

ROOT = Path(__file__).resolve().parents[2]
LOGS = Path(__file__).parent / "race_logs"
race = load_script("scripts/race.py", register=True)  # its dataclasses look their module up in sys.modules

ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "torch": "2.11.0+cu130", "triton": "3.6.0"}


# --- statistics -------------------------------------------------------------------------------


def test_summary_counts_the_runs_below_the_bar():
    s = race.summarize([94.5, 93.9, 94.1, 93.99], [1.0, 1.2, 1.1, 1.3], bar=94.0)
    assert s["runs"] == 4 and s["below_bar"] == 2 and s["acc_min"] == 93.9
    assert (
        s["acc_mean"] == pytest.approx(94.1225) and s["time_mean_s"] == pytest.approx(1.15) and s["time_max_s"] == 1.3
    )
    assert 0.0 < s["p_value"] < 1.0


# --- the public scripts' printed results ------------------------------------------------------


def test_hiverge_log_gives_its_timed_runs_without_the_warm_up_or_a_cut_off_row():
    raw = (LOGS / "hiverge.log").read_bytes().decode()
    assert "\r" in raw  # its progress line ends in a carriage return, its next row follows on the same line
    runs = race.parse_peer_log(raw)
    assert [round(a, 2) for a, _ in runs] == [94.28, 93.95, 93.91]  # warm-up (9.92%, 34.7 s) left out
    assert [t for _, t in runs] == [1.9734, 1.9739, 1.9745]


def test_airbench94_muon_log_gives_each_runs_eval_row():
    runs = race.parse_peer_log((LOGS / "airbench94_muon.log").read_text())
    assert [round(a, 2) for a, _ in runs] == [94.05, 93.91, 94.12]  # warm-up and the cut-off 4th run left out
    assert [t for _, t in runs] == [2.58, 2.58, 2.58]  # the eval row's time: the whole run's clock


def test_airbench94_log_has_no_warm_up_and_a_seventh_column():
    runs = race.parse_peer_log((LOGS / "airbench94.log").read_text())
    assert [round(a, 2) for a, _ in runs] == [93.98, 94.07, 94.02] and {t for _, t in runs} == {3.83}


def test_a_log_without_the_table_gives_no_runs():
    assert race.parse_peer_log("Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error\n") == []


# --- the edits the race may make ---------------------------------------------------------------


def fake_script(peer) -> str:
    return f"import torch\n{peer.run_count[0]}\n" + "".join(f"    {old}\n" for old, _ in peer.other_edits)


def test_edits_change_only_the_run_count_and_the_sleep():
    hiverge = next(p for p in race.PEERS if p.name == "hiverge")
    out = race.edited(hiverge, fake_script(hiverge), runs=25)
    assert out == "import torch\nfor run in range(25):\n    pass\n"
    with pytest.raises(race.RaceError, match="found it 0 times"):
        race.edited(hiverge, "import torch\n", runs=25)  # another version of the script: refused
    with pytest.raises(race.RaceError, match="found it 2 times"):
        race.edited(hiverge, fake_script(hiverge) * 2, runs=25)


def test_prepare_copies_each_script_beside_a_link_to_the_images(tmp_path, monkeypatch):
    scripts, images = tmp_path / "scripts", tmp_path / "images"
    scripts.mkdir(), images.mkdir()
    (images / "train.pt").write_bytes(b"x"), (images / "test.pt").write_bytes(b"x")
    peers = []
    for peer in race.PEERS[:2]:  # the third is missing: skipped with a line
        text = fake_script(peer)
        (scripts / peer.file).write_text(text)
        peers.append(dataclasses.replace(peer, sha256=hashlib.sha256(text.encode()).hexdigest()))
    monkeypatch.setattr(race, "PEERS", (*peers, race.PEERS[2]))
    said = []
    assert race.prepare(scripts, tmp_path / "work", images, runs=7, log=said.append) == ["hiverge", "airbench94_muon"]
    assert "range(7)" in (tmp_path / "work" / "hiverge" / "cifar10_speedrun.py").read_text()
    assert (tmp_path / "work" / "airbench94_muon" / "cifar10" / "test.pt").read_bytes() == b"x"
    assert any(line.startswith("airbench94: no ") for line in said)
    # again into the same folder (a second call on a warm machine): the link is replaced
    assert race.prepare(scripts, tmp_path / "work", images, runs=3, log=said.append) == ["hiverge", "airbench94_muon"]


def race_cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """scripts/race.py run as a command, its output captured as text."""
    cmd = [sys.executable, str(ROOT / "scripts" / "race.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_prepare_refuses_a_script_that_is_not_the_named_commit(tmp_path):
    (tmp_path / "scripts").mkdir(), (tmp_path / "images").mkdir()
    (tmp_path / "images" / "train.pt").write_bytes(b""), (tmp_path / "images" / "test.pt").write_bytes(b"")
    (tmp_path / "scripts" / "cifar10_speedrun.py").write_text("print('a newer record')\n")
    proc = race_cli(
        "prepare", str(tmp_path / "scripts"), str(tmp_path / "work"), "--images", str(tmp_path / "images"), timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "is not hiverge/cifar10-speedrun:cifar10_speedrun.py at 06c6072" in proc.stderr
    assert not (tmp_path / "work" / "hiverge" / "cifar10_speedrun.py").exists()
    proc = race_cli(
        "prepare", str(tmp_path / "scripts"), str(tmp_path / "work"), "--images", str(tmp_path / "nothing"), timeout=60
    )
    assert proc.returncode == 2 and "no train.pt (scripts/export_tensors.py writes it)" in proc.stderr


# --- the report -------------------------------------------------------------------------------


def write_runs(
    root: Path, preset: str, accs: list[float], train: float = 1.40, test: float = 0.07, folder_name: str = "", **config
) -> None:
    results = []
    for i, acc in enumerate(accs):
        epochs = [
            EpochRecord(
                run=i + 1,
                epoch=e + 1,
                lr=0.1,
                train_time=train / 2,
                train_loss=1.0,
                train_acc=90.0,
                test_time=test,
                test_loss=0.5,
                test_acc=acc,
                total_train_time=train / 2 * (e + 1),
            )
            for e in range(2)
        ]
        results.append(
            dataclasses.asdict(
                RunResult(
                    run=i + 1, seed=i, test_acc=acc, train_time=train, wall_time=9.0, setup_time=4.0 + i, epochs=epochs
                )
            )
        )
    folder = root / (folder_name or f"{preset}-runs") / "2026-11-26-x"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"config": {"preset": preset, **config}, "results": results}))


def official(tmp_path: Path) -> Path:
    from conftest import write_official

    folder, _ = write_official(tmp_path / "data" / "cifar-10-batches-py", per_batch=2, n_test=2)
    return folder


def test_report_rows_count_fastcifar_as_the_public_scripts_count(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in ("hiverge", "airbench94_muon"):  # airbench94 did not run (no copy, or no time)
        shutil.copy(LOGS / f"{name}.log", work / f"{name}.log")
    write_runs(work / "runs", "fast-muon320", [94.1, 94.3, 94.2, 94.4], train=1.40, test=0.07)
    lines, rows, problems = race.report(
        work, work / "runs", official(tmp_path), call="visit 8", commit="abc1234", env=ENV, today="2026-11-26"
    )
    assert problems == []
    assert [r["trainer"] for r in rows] == ["fastcifar:fast-muon320", "hiverge@06c6072", "airbench94_muon@f1c599c"]
    mine, hiverge, muon = rows
    for row in rows:  # what the issue asks of every row
        for key in (
            "call",
            "date",
            "device",
            "driver",
            "torch",
            "triton",
            "data",
            "trainer",
            "runs",
            "acc_mean",
            "acc_std",
            "acc_min",
            "below_bar",
            "p_value",
            "time_mean_s",
            "time_max_s",
            "clock",
        ):
            assert key in row, (row["trainer"], key)
        assert row["data"] == "cifar10-official" and row["call"] == "visit 8" and row["commit"] == "abc1234"
        assert row["device"] == ENV["device"] and row["date"] == "2026-11-26"
    # fastcifar: its train clock plus the final (TTA) evaluation, the span the public scripts clock
    assert mine["time_mean_s"] == pytest.approx(1.47) and mine["train_clock_mean_s"] == pytest.approx(1.40)
    # what a user waits for before the clock, filed beside it: run 1's (the compiles), and the mean
    assert mine["setup_first_s"] == pytest.approx(4.0) and mine["setup_mean_s"] == pytest.approx(5.5)
    assert mine["runs"] == 4 and mine["below_bar"] == 0 and mine["acc_mean"] == pytest.approx(94.25)
    assert mine["p_value"] == pytest.approx(t_sf(0.25 / (math.sqrt(0.05 / 3) / 2), 3))
    assert (
        hiverge["runs"] == 3
        and hiverge["below_bar"] == 2
        and hiverge["time_mean_s"] == pytest.approx(1.97393, abs=1e-5)
    )
    assert hiverge["ratio_fastcifar_fast-muon320"] == pytest.approx(1.47 / 1.9739333, rel=1e-6)
    assert muon["ratio_fastcifar_fast-muon320"] == pytest.approx(1.47 / 2.58)
    text = "\n".join(lines)
    assert "| fastcifar:fast-muon320 | 4 | 94.25 ± 0.13 (94.10) | 0 |" in text
    assert "fastcifar:fast-muon320 / hiverge: 1.470 / 1.974 s = **0.745**" in text


def test_report_races_fused_conv_runs_as_their_own_contender(tmp_path):
    """gpu_visit.sh conv: the default preset with and without --fused-conv, no public script: one
    row each, told apart by the flag (both runs name the same preset)."""
    work = tmp_path / "work"
    work.mkdir()
    write_runs(work / "runs", "fast-muon320", [94.2, 94.3], train=1.40, folder_name="cudnn", fused_conv=False)
    write_runs(work / "runs", "fast-muon320", [94.1, 94.3], train=1.30, folder_name="fused", fused_conv=True)
    lines, rows, problems = race.report(
        work, work / "runs", official(tmp_path), call="visit 9", commit="abc1234", env=ENV, today="2026-11-26"
    )
    assert problems == []
    assert [r["trainer"] for r in rows] == ["fastcifar:fast-muon320", "fastcifar:fast-muon320 --fused-conv"]
    for row in rows:  # every row says where it was measured, a variant's too
        assert (row["call"], row["commit"], row["data"], row["device"], row["date"]) == (
            "visit 9",
            "abc1234",
            "cifar10-official",
            ENV["device"],
            "2026-11-26",
        ), row
    assert rows[1]["train_clock_mean_s"] == pytest.approx(1.30) and rows[1]["acc_mean"] == pytest.approx(94.2)


def test_report_screens_variants_of_a_preset_beside_it(tmp_path):
    """gpu_visit.sh screen: the default and variants of it, each named by the flags that made its
    recipe differ, with its time ratio and accuracy difference to the default in its row."""
    work = tmp_path / "work"
    work.mkdir()
    write_runs(work / "runs", "fast-muon320", [94.2, 94.4], train=1.40, folder_name="screen-0")
    write_runs(work / "runs", "fast-muon320", [94.0, 94.2], train=1.19, folder_name="screen-1", epochs=7)
    write_runs(
        work / "runs",
        "fast-muon320",
        [93.9, 94.1],
        train=1.26,
        folder_name="screen-2",
        widths=[64, 288, 288],
        seed=5,
        runs=10,
        data="elsewhere",
    )  # seed, run count, data: not the recipe
    shutil.copy(LOGS / "airbench94.log", work / "airbench94.log")  # a peer's row after the variants
    lines, rows, problems = race.report(
        work, work / "runs", official(tmp_path), call="visit 10", commit="abc1234", env=ENV, today="2026-11-26"
    )
    assert problems == []
    assert [r["trainer"] for r in rows] == [
        "fastcifar:fast-muon320",
        "fastcifar:fast-muon320 --epochs 7",
        "fastcifar:fast-muon320 --widths 64,288,288",
        "airbench94@f1c599c",
    ]
    for row in rows:  # every row says where it was measured, after the variants too
        assert (row["call"], row["commit"], row["data"], row["device"], row["date"]) == (
            "visit 10",
            "abc1234",
            "cifar10-official",
            ENV["device"],
            "2026-11-26",
        ), row
    assert "variant_of" not in rows[0]
    assert rows[1]["variant_of"] == "fastcifar:fast-muon320"
    assert rows[1]["time_ratio_to_preset"] == pytest.approx(1.26 / 1.47)  # each with its final evaluation (0.07 s)
    assert rows[1]["acc_diff_to_preset"] == pytest.approx(-0.2)
    assert (
        "fastcifar:fast-muon320 --widths 64,288,288 beside fastcifar:fast-muon320: time x0.905, accuracy -0.30 points"
        in "\n".join(lines)
    )


@pytest.mark.slow  # over 2 s on 2 cores
def test_report_without_fastcifar_runs_fails_but_files_the_public_scripts(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(LOGS / "airbench94.log", work / "airbench94.log")
    (work / "hiverge.log").write_text("Traceback (most recent call last):\n")
    jsonl = tmp_path / "official.jsonl"
    jsonl.write_text('{"earlier": "row"}\n')
    proc = race_cli(
        "report",
        str(work),
        "--fastcifar",
        str(work / "runs"),
        "--data",
        str(tmp_path / "jpeg"),
        "--jsonl",
        str(jsonl),
        timeout=120,
    )
    assert proc.returncode == 1
    assert "PROBLEM: no fastcifar summary.json under" in proc.stdout
    assert "PROBLEM: hiverge: no finished run in" in proc.stdout
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert rows[0] == {"earlier": "row"}  # appended, never rewritten
    assert [r["trainer"] for r in rows[1:]] == ["airbench94@f1c599c"] and rows[1]["data"] == "other:jpeg"
    assert rows[1]["device"]  # the machine it ran on, as torch names it ("cpu" here)


# --- levers -----------------------------------------------------------------------------------


def test_levers_are_the_fields_where_the_candidate_differs_each_alone(monkeypatch):
    """gpu_visit.sh levers times each field where the candidate preset differs from the base alone:
    read from the presets table, so a field the candidate gains is a lever with no edit here."""
    levers = race.lever_variants("fast-jitter", base="fast-muon9")
    assert levers == ["--epochs 8.5", "--brightness 0.14", "--contrast 0.13"]
    # a candidate added to the table later (here: the base with two fields changed)
    monkeypatch.setitem(race.PRESETS, "cand", {**race.PRESETS["fast-muon9"], "label_smoothing": 0.1, "tta": 1})
    levers = race.lever_variants("cand", base="fast-muon9")
    assert levers == ["--label-smoothing 0.1", "--tta 1"]
    race.check_variants("fast-muon9", levers)  # each alone a recipe of its own the stage can race
    assert race.main(["levers", "cand", "--base", "fast-muon9"]) == 0


@pytest.mark.parametrize(
    "candidate, base, says",
    [
        ("no-such-preset", None, "no preset 'no-such-preset'"),
        ("fast-muon9", "fast-muon9", "trains the fast-muon9 recipe itself"),
    ],
)
def test_levers_of_a_missing_or_equal_preset_are_refused_in_one_line(capsys, candidate, base, says):
    assert race.main(["levers", candidate, *(["--base", base] if base else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("race: ") and says in err and err.count("\n") == 1, err
