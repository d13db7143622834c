"""gpu_visit.sh nccl2 (issue 46): two NCCL ranks on the visit's one GPU, prepared on the CPU.

What runs here: the stage's command lines (torchrun's --no-python entry through scripts/rank_env.sh,
the comparison runs, the kill step), the wrapper under a real torchrun (each rank's environment),
scripts/kill_rank.py against stand-in ranks joined by a socket (a SIGKILL closes it, as it closes a
gloo or NCCL socket), and the report on fake summary.json files and logs. What only the GPU shows:
whether NCCL accepts the ranks, and how its socket transport behaves when a peer dies.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli import torchrun
from script_modules import load_script
from test_gpu_visit import ROOT, report, visit, write_run

# A stand-in for one rank of the trainer: rank 1 listens on MASTER_PORT and waits to be killed;
# rank 0 connects, prints the epoch header (the trainer's sign that it is training), blocks until
# the socket closes, then ends as FAKE_MODE says: "keep" the promise (one line, exit 3), "exit0",
# "early" (exit 1 before training) or "hang" (never trains). Each prints its pid last.
FAKE_RANK = r"""
import os, socket, sys, time
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
print("argv", *sys.argv[1:], "world", os.environ["WORLD_SIZE"], "local", os.environ["LOCAL_RANK"], os.getpid(),
      flush=True)
mode = os.environ["FAKE_MODE"]
if mode == "hang":
    time.sleep(120)
if rank == 1:
    server = socket.create_server(("127.0.0.1", port))
    server.accept()
    time.sleep(120)
    sys.exit(0)
if mode == "early":
    sys.exit(1)
for _ in range(400):
    try:
        peer = socket.create_connection(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.05)
print(" run epoch       lr train_loss", flush=True)
peer.recv(1)
if mode == "keep":
    print("fastcifar: error: [rank 0] lost contact with the other ranks (peer closed)", file=sys.stderr)
    sys.exit(3)
sys.exit(0)
"""


def dry_lines(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]


def test_the_stage_runs_two_ranks_through_the_wrapper_then_compares_and_kills(tmp_path):
    proc, out = visit(tmp_path, "nccl2", NCCL2_CALL="visit 10", NCCL2_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    table = (out / "nccl2-table.md").read_text()
    steps = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| nccl2")]
    assert steps == [
        "nccl2-ranks",
        "nccl2-same",
        "nccl2-same-1rank",
        "nccl2-kill",
        "nccl2-shard",
        "nccl2-emulated",
        "nccl2-1rank",
        "nccl2-checks",
    ], table
    lines = dry_lines(proc)
    short = "--subset 10000 --epochs 2 --cuda-graphs on --comm bucketed --loader torch"
    py, data = sys.executable, tmp_path / "cifar.tar.gz"
    ranks = next(line for line in lines if "torch.distributed.run" in line)
    # torchrun of $PYTHON's torch; --no-python: the entry is bash running the wrapper, which execs the trainer
    assert (
        f"dry run: {py} -m torch.distributed.run --standalone --nproc_per_node 2 --no-python "
        f"bash scripts/rank_env.sh {py} -m fastcifar.train --data {data} --out-dir "
    ) in ranks, ranks
    assert ranks.endswith(f"/runs/nccl2-ranks {short} --share-gpu"), ranks
    # one process over the same global batch: as the ranks train it (emulated), and plain
    assert any(line.endswith(f"/runs/nccl2-emulated --emulate-ranks 2 {short}") for line in lines), lines
    assert any(line.endswith(f"/runs/nccl2-1rank {short}") for line in lines), lines
    # both ranks fed rank 0's data (the harness's flags) with deterministic kernels, against
    # one process given the same data and rank 0's 2500 whitening images; then --muon-shard on 2 ranks
    same = "dry run: env CUBLAS_WORKSPACE_CONFIG=:4096:8 "
    same_ranks = next(line for line in lines if line.startswith(same) and "torch.distributed.run" in line)
    assert same_ranks.endswith(
        f"/runs/nccl2-same {short} --kernels torch --rank0-data 2 --deterministic --share-gpu"
    ), same_ranks
    same_one = next(line for line in lines if line.startswith(same) and "torch.distributed.run" not in line)
    assert same_one.endswith(
        f"/runs/nccl2-same-1rank {short} --kernels torch --rank0-data 2 --deterministic --whiten-images 2500"
    ), same_one
    assert f"{same}{py} -m fastcifar.train --data {data} --out-dir " in same_one, same_one
    shard = next(line for line in lines if "/runs/nccl2-shard " in line)
    assert "bash scripts/rank_env.sh" in shard and shard.endswith(f"{short} --muon-shard --share-gpu"), shard
    kill = next(line for line in lines if "kill_rank.py" in line)
    assert "--ranks 2 --kill 1 --after-s 3 --dist-timeout-s 10 --ready-s 90 --out " in kill
    assert "torch.distributed.run" not in kill  # torchrun would stop rank 0 itself when rank 1 dies
    assert kill.endswith(
        f"-- bash scripts/rank_env.sh {py} -m fastcifar.train --data {data} --subset 10000 "
        "--epochs 200 --cuda-graphs on --comm bucketed --loader torch --share-gpu"
    ), kill
    checks = next(line for line in lines if "gpu_visit_report.py nccl2" in line)
    folder = kill.split("--out ")[1].split(" ")[0]
    for part in (
        "/nccl2-ranks.log",
        f"--kill {folder}/kill.json",
        "/nccl2-ranks.ended --jsonl",
        "--jsonl bench/results/multi_gpu.jsonl",
        "--call visit 10",
        "--commit abc1234",
    ):
        assert part in checks, checks


@pytest.mark.slow  # over 2 s on 2 cores
def test_the_wrapper_gives_each_rank_under_torchrun_its_own_nccl_host(tmp_path):
    """torchrun --no-python runs `bash scripts/rank_env.sh COMMAND` per rank; COMMAND sees the rank's
    environment (here it prints it)."""
    show = (
        "import os; print(*(os.environ.get(k) for k in ('RANK', 'NCCL_HOSTID', 'FASTCIFAR_SHARE_GPU', "
        "'NCCL_IB_DISABLE', 'NCCL_SOCKET_IFNAME', 'NCCL_DEBUG')))"
    )
    proc = subprocess.run(
        torchrun("--no-python", "bash", "scripts/rank_env.sh", sys.executable, "-c", show),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NCCL_HOSTID": "same-for-all", "NCCL_DEBUG": "WARN"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = sorted(line for line in proc.stdout.splitlines() if line[:1] in "01")
    # a host id per rank even where one was set for all (it is what lets NCCL take two ranks on one
    # GPU); the user's NCCL_DEBUG kept; the GPU shared by the trainer's --share-gpu, no variable
    assert seen == ["0 fastcifar-rank0 None 1 lo WARN", "1 fastcifar-rank1 None 1 lo WARN"], proc.stdout
    alone = subprocess.run(
        ["bash", "scripts/rank_env.sh", "true"], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1 and "RANK is not set" in alone.stderr


@pytest.mark.parametrize(
    "mode, ok, message",
    [
        ("keep", True, "rank 1 killed; every other rank ended with exit 3 and one line within"),
        ("exit0", False, "rank 0: exit 0, not 3, 0 'fastcifar: error:' lines, not one naming lost contact"),
        ("early", False, "no kill: before training, rank 0 exited 1"),
    ],
)
def test_kill_rank_kills_rank_1_once_rank_0_trains_and_judges_how_rank_0_ends(tmp_path, mode, ok, message):
    fake = tmp_path / "fake_rank.py"
    fake.write_text(FAKE_RANK)
    out = tmp_path / "kill"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "kill_rank.py"),
            "--after-s",
            "0.2",
            "--out",
            str(out),
            "--dist-timeout-s",
            "7",
            "--",
            sys.executable,
            str(fake),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"FAKE_MODE": mode, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == (0 if ok else 1), proc.stdout + proc.stderr
    verdict = json.loads((out / "kill.json").read_text())
    assert verdict["ok"] is ok and verdict["message"].startswith(message), verdict
    assert proc.stdout == f"kill_rank: {'ok' if ok else 'FAIL'}: {verdict['message']}\n"
    assert verdict["bound_s"] == 18 and verdict["killed"] == 1  # --dist-timeout-s + 11 s
    # each rank got torchrun's environment and the trainer's timeout and run folder; rank 1 only
    # where rank 0 trained, for rank 0 reaches training through rank 1's socket (an early rank 0
    # may end before rank 1's interpreter has printed anything: kill_rank.py then kills it)
    ranks = (0,) if mode == "early" else (0, 1)
    for rank in ranks:
        argv = (out / f"rank{rank}.out").read_text().splitlines()[0].split()
        flags = ["--dist-timeout-s", "7", "--out-dir", str(out / "runs")]
        assert argv[:-1] == ["argv", *flags, "world", "2", "local", str(rank)], (rank, argv)
    if mode != "early":
        (survivor,) = verdict["survivors"]
        assert survivor["rank"] == 0 and survivor["exit"] == (3 if ok else 0)


def test_kill_rank_stopped_by_a_step_limit_takes_its_ranks_with_it(tmp_path):
    """gpu_visit.sh's step limit sends kill_rank.py a SIGTERM: no rank may stay behind on the GPU."""
    import os
    import signal
    import time

    fake = tmp_path / "fake_rank.py"
    fake.write_text(FAKE_RANK)
    out = tmp_path / "kill"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "kill_rank.py"), "--out", str(out), "--", sys.executable, str(fake)],
        env={"FAKE_MODE": "hang", "PATH": "/usr/bin:/bin"},
    )
    deadline = time.monotonic() + 30
    while not all((out / f"rank{r}.out").is_file() and (out / f"rank{r}.out").read_text() for r in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int((out / f"rank{r}.out").read_text().split()[-1]) for r in (0, 1)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a rank outlived kill_rank.py"


def test_kill_rank_fails_a_survivor_past_the_bound_or_still_running(tmp_path):
    kill_rank = load_script("scripts/kill_rank.py")
    (tmp_path / "rank0.err").write_text("fastcifar: error: [rank 0] lost contact with the other ranks (x)\n")
    (tmp_path / "rank2.err").write_text("")
    ok, survivors = kill_rank.verdict({0: (3, 20.5)}, tmp_path, bound_s=21.0, slack_s=5.0)
    assert ok and survivors[0]["problems"] == []
    ok, survivors = kill_rank.verdict({0: (3, 26.5), 2: (None, 56.0)}, tmp_path, bound_s=21.0, slack_s=5.0)
    assert not ok
    assert survivors[0]["problems"] == ["ended 26.5 s after the kill, past the bound 21 s + 5 s"]
    assert survivors[1]["problems"] == [
        "still running 56.0 s after the kill",
        "0 'fastcifar: error:' lines, not one naming lost contact",
    ]
    assert kill_rank.main(["--out", str(tmp_path), "--kill", "0", "--", "true"]) == 2  # rank 0 keeps the record


# --- the report -----------------------------------------------------------------------------------

GPU = {
    "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "world_size": 1},
    "versions": {"torch": "2.11.0", "triton": "3.6.0"},
}
TWO = {**GPU, "device": {**GPU["device"], "world_size": 2}}
SOCKET_LOG = "host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n"


def issue73_runs(tmp_path, runs, exit_s, same_loss=1.5, shard=True):
    """The same-data pair (the 2 ranks' second-epoch loss ``same_loss``), a --muon-shard run, and the
    launcher's end mark ``exit_s`` after the 2-rank run's summary.json; returns the mark's path."""
    write_run(runs, "nccl2-same", [2.0, same_loss], engine={"comm": "bucketed"}, **TWO)
    write_run(runs, "nccl2-same-1rank", [2.0, 1.5], **GPU)
    if shard:
        write_run(runs, "nccl2-shard", [2.0, 1.502], engine={"comm": "bucketed"}, config={"muon_shard": True}, **TWO)
    (summary,) = (runs / "nccl2-ranks").glob("**/summary.json")
    ended = tmp_path / "nccl2-ranks.ended"
    ended.write_text(f"{summary.stat().st_mtime + exit_s:.3f}\n")
    return ended


def kill_json(folder, ok=True):
    folder.mkdir(parents=True, exist_ok=True)
    verdict = {
        "check": "kill-rank",
        "ranks": 2,
        "killed": 1,
        "dist_timeout_s": 10.0,
        "bound_s": 21.0,
        "slack_s": 5.0,
        "ok": ok,
        "seconds": 12.3 if ok else 40.0,
        "survivors": [{"rank": 0, "exit": 3 if ok else None}],
        "message": "rank 1 killed; every other rank ended with exit 3 and one line within 12.3 s (bound 21 s)"
        if ok
        else "rank 0: still running 40.0 s after the kill",
    }
    (folder / "kill.json").write_text(json.dumps(verdict))
    return folder / "kill.json"


def nccl2_report(tmp_path, runs, log_text, kill, ended=None):
    log = tmp_path / "nccl2-ranks.log"
    log.write_text(log_text)
    jsonl = tmp_path / "multi_gpu.jsonl"
    extra = ["--ended", ended] if ended is not None else []
    proc = report(
        "nccl2",
        runs,
        "--log",
        log,
        "--kill",
        kill,
        "--jsonl",
        jsonl,
        "--call",
        "visit 10",
        "--commit",
        "abc1234",
        *extra,
    )
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return proc, rows


def test_report_passes_two_ranks_that_match_one_process_and_files_both_checks(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "nccl2-ranks", [2.0, 1.500], engine={"comm": "bucketed"}, **TWO)
    write_run(runs, "nccl2-emulated", [2.0, 1.505], config={"emulate_ranks": 2}, **GPU)  # 0.33% apart
    write_run(runs, "nccl2-1rank", [2.02, 1.54], **GPU)  # 2.6% apart: batchnorm over the global batch
    ended = issue73_runs(tmp_path, runs, exit_s=2.5)
    proc, rows = nccl2_report(tmp_path, runs, SOCKET_LOG, kill_json(tmp_path / "kill"), ended)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| nccl2-ranks | 2 (NCCL) | 2.0000 > 1.5000 |" in proc.stdout
    assert (
        "2 ranks vs --emulate-ranks 2 over the same global batch: per-epoch train loss at most 0.33% apart "
        "(bound 1%)" in proc.stdout
    )
    assert "NCCL transport: NET/Socket/0" in proc.stdout and "kill -9 of rank 1: ok" in proc.stdout
    match, same, shard, exit_row, kill = rows
    assert same["check"] == "nccl-2-ranks-same-data-bit-exact" and same["ok"] is True, same
    assert shard["check"] == "nccl-2-ranks-muon-shard" and shard["ok"] is True and shard["train_loss"] == [2.0, 1.502]
    assert exit_row["check"] == "nccl-exit-after-graphs" and exit_row["seconds"] == pytest.approx(2.5, abs=0.01)
    assert "exit after the graphed NCCL run: ok: the launcher ended 2.5 s after" in proc.stdout
    assert match["check"] == "nccl-2-ranks-one-gpu" and match["ok"] is True and match["transport"] == "NET/Socket/0"
    assert match["gap_emulated_pct"] == pytest.approx(0.332, abs=1e-3)
    assert match["gap_1rank_pct"] == pytest.approx(2.597, abs=1e-3)
    assert match["train_loss"] == [2.0, 1.5] and match["reference_train_loss"]["nccl2-emulated"] == [2.0, 1.505]
    for row in rows:
        assert (row["device"], row["torch"], row["world_size"], row["backend"]) == (
            "NVIDIA H100 80GB HBM3",
            "2.11.0",
            2,
            "nccl",
        )
        assert row["call"] == "visit 10" and row["commit"] == "abc1234"
    assert kill["check"] == "nccl-2-ranks-kill" and kill["ok"] is True and kill["seconds"] == 12.3


def test_report_fails_ranks_that_train_apart_or_a_kill_that_broke_the_promise(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "nccl2-ranks", [2.0, 1.50], engine={"comm": "bucketed"}, **TWO)
    write_run(runs, "nccl2-emulated", [2.0, 1.53], config={"emulate_ranks": 2}, **GPU)  # 2% apart: not the same math
    write_run(runs, "nccl2-1rank", [2.0, 1.52], **GPU)
    # the same-data pair one bit apart in one epoch's loss, a hung exit, no --muon-shard run
    ended = issue73_runs(tmp_path, runs, exit_s=40.0, same_loss=1.5000000000000002, shard=False)
    proc, rows = nccl2_report(tmp_path, runs, SOCKET_LOG, kill_json(tmp_path / "kill", ok=False), ended)
    assert proc.returncode == 1
    assert "PROBLEM: 2 ranks vs --emulate-ranks 2: train loss 1.96% apart, past 1%" in proc.stdout
    assert "PROBLEM: kill test: rank 0: still running 40.0 s after the kill" in proc.stdout
    assert "PROBLEM: same-data check: epoch 2: 2 ranks (1.5000000000000002, 50.0, 91.0) != 1 process" in proc.stdout
    assert "PROBLEM: --muon-shard: no nccl2-shard run" in proc.stdout
    assert "PROBLEM: exit: the launcher ended 40.0 s after" in proc.stdout
    assert [r["ok"] for r in rows] == [False] * 5
    # a run without its process group is no 2-rank run, and a missing verdict is a problem
    (tmp_path / "multi_gpu.jsonl").unlink()
    alone = tmp_path / "alone"
    write_run(alone, "nccl2-ranks", [2.0, 1.5], **GPU)
    proc, _ = nccl2_report(tmp_path, alone, "", tmp_path / "missing.json")
    assert "the nccl2-ranks run was not 2 ranks in a process group" in proc.stdout
    assert "no kill verdict" in proc.stdout and proc.returncode == 1


def test_report_records_nccls_refusal_when_two_ranks_on_one_gpu_are_refused(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "nccl2-emulated", [2.0, 1.5], config={"emulate_ranks": 2}, **GPU)
    refused = (
        "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid "
        "usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3\n"
        "host:2:2 [0] init.cc:934 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000\n"
    )
    proc, rows = nccl2_report(tmp_path, runs, "torchrun noise\n" + refused, kill_json(tmp_path / "kill"))
    assert proc.returncode == 1
    line = (
        "NCCL: host:2:2 [0] init.cc:934 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
    )
    assert f"PROBLEM: 2 ranks on one GPU did not train: {line}" in proc.stdout
    assert rows[0]["ok"] is False and rows[0]["message"] == line and rows[0]["device"] == "NVIDIA H100 80GB HBM3"
    # another NCCL failure: its first warning or error line; none: the report says NCCL was silent
    # (rows[-5]: each report appends its 5 rows, the 2-rank check first)
    proc, rows = nccl2_report(tmp_path, runs, refused.splitlines()[0], kill_json(tmp_path / "kill"))
    assert proc.returncode == 1 and rows[-5]["ok"] is False
    assert rows[-5]["message"].startswith("NCCL: [rank1]: torch.distributed.DistBackendError: NCCL error in:")
    proc, rows = nccl2_report(tmp_path, runs, "Traceback ...\n", kill_json(tmp_path / "kill"))
    assert proc.returncode == 1 and rows[-5]["ok"] is False
    assert "left no summary.json and NCCL said nothing (see nccl2-ranks.log)" in rows[-5]["message"]


@pytest.mark.parametrize(
    "mine, other, ok",
    [
        (torch.ones(4), torch.ones(4), True),
        (torch.ones(4), torch.ones(1), False),  # (x == y).all() broadcast it against the [4] tensor: "equal to the bit"
        (torch.ones(4), torch.ones(2, 2), False),
        (torch.ones(4), torch.ones(4, dtype=torch.float16), False),
        (torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 2.0]), False),
        (torch.zeros(4), -torch.zeros(4), False),  # equal values (torch.equal), other bits
    ],
)
def test_same_data_holds_the_model_files_to_shape_dtype_and_bits(mine, other, ok, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as a script: race.py beside it
    report_module = load_script("scripts/gpu_visit_report.py", monkeypatch=monkeypatch)
    epochs = [{"train_loss": 2.0, "train_acc": 50.0, "test_acc": 60.0}]
    first = {
        report_module.SAME: {"_device": {"world_size": 2}, "_engine": {"comm": "bucketed"}, "epochs": epochs},
        report_module.SAME1: {"_device": {"world_size": 1}, "_engine": {}, "epochs": epochs},
    }
    for name, tensors in ((report_module.SAME, {"w": mine}), (report_module.SAME1, {"w": other})):
        (tmp_path / name / "run").mkdir(parents=True)
        save_file(tensors, str(tmp_path / name / "run" / "model.safetensors"))
    passed, message = report_module.same_data(tmp_path, first)
    assert passed is ok and message == (
        "per-epoch figures and all 1 weight tensors equal to the bit" if ok else "the weights differ: w"
    )
