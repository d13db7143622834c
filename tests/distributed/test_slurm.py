"""Processes started by Slurm's srun (issue 73): torchrun's variables mapped from Slurm's, one GPU
visible per task, and two srun tasks on gloo equal to one torchrun launcher of two processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cli import ROOT, SHORT, env, epochs_of, free_port, run_train, summary_of, torchrun
from conftest import write_official
from gpus import fake_gpus

from fastcifar.core.config import ConfigError
from fastcifar.parallel import distributed
from fastcifar.parallel.distributed import first_host, pick_device, slurm_environment

# What srun gives task 1 of a 2-task step on one node (srun --ntasks 2), job 12345.
TASK = {
    "SLURM_JOB_ID": "12345",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NODELIST": "gpu07",
}


def test_slurm_task_maps_to_torchruns_variables():
    assert slurm_environment(TASK) == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(distributed.SLURM_PORT_BASE + 12345 % distributed.SLURM_PORT_SPAN),
    }
    two_nodes = dict(TASK, SLURM_STEP_NUM_NODES="2", SLURM_NNODES="2", SLURM_STEP_NODELIST="gpu[07-08]")
    assert slurm_environment(two_nodes)["MASTER_ADDR"] == "gpu07"
    exported = dict(two_nodes, MASTER_ADDR="10.0.0.5", MASTER_PORT="29400")
    assert not {"MASTER_ADDR", "MASTER_PORT"} & set(slurm_environment(exported)), "exported: kept as they are"
    # torchrun inside the allocation sets its own; an sbatch script's shell is no srun task
    assert slurm_environment(dict(TASK, RANK="3", WORLD_SIZE="16")) == {}
    assert slurm_environment({k: v for k, v in TASK.items() if k != "SLURM_STEP_NUM_TASKS"}) == {}
    assert slurm_environment(dict(TASK, SLURM_DISTRIBUTION="block:cyclic"))["RANK"] == "1"
    with pytest.raises(ConfigError, match="--distribution cyclic: fastcifar needs each node's tasks numbered"):
        slurm_environment(dict(TASK, SLURM_DISTRIBUTION="cyclic"))
    # no more tasks than nodes: any layout numbers a node's tasks one after another (srun sets cyclic itself)
    alone = dict(TASK, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="1", SLURM_DISTRIBUTION="cyclic")
    assert slurm_environment(alone)["WORLD_SIZE"] == "1"
    assert slurm_environment(dict(two_nodes, SLURM_LOCALID="0", SLURM_DISTRIBUTION="cyclic"))["RANK"] == "1"
    # a second step of the job at the same time gets another port
    assert slurm_environment(dict(TASK, SLURM_STEP_ID="1"))["MASTER_PORT"] != slurm_environment(TASK)["MASTER_PORT"]
    with pytest.raises(ConfigError, match="export MASTER_ADDR"):
        slurm_environment({k: v for k, v in two_nodes.items() if k != "SLURM_STEP_NODELIST"})


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu07", "gpu07"),
        ("gpu[07-08]", "gpu07"),
        ("gpu[03-04,07],cpu1", "gpu03"),
        ("a1,b2", "a1"),
        ("r1-[2-3]x", "r1-2x"),
    ],
)
def test_slurm_first_host_of_a_node_list(nodelist, first, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # Slurm's tools absent: the list's own syntax
    assert first_host(nodelist) == first


def test_slurm_task_with_one_visible_gpu_takes_it(monkeypatch):
    """srun --gpus-per-task 1: local rank 5 sees one GPU, its own, and takes cuda:0; under torchrun
    (every rank sees the node's GPUs) local rank 5 with one GPU visible is refused."""
    chosen = fake_gpus(monkeypatch, 1)  # an H100 torch has code for: the preflight passes
    assert pick_device("auto", 5, own_gpus=True) == torch.device("cuda", 0) and chosen == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # more tasks on a node than its GPUs: no sharing
    with pytest.raises(ConfigError, match="local rank 5 has no GPU"):
        pick_device("auto", 5, own_gpus=True)
    with pytest.raises(ConfigError, match="local rank 5 has no GPU"):
        pick_device("auto", 5)


@pytest.mark.slow
def test_two_slurm_tasks_equal_one_torchrun_launcher_of_two(tmp_path):
    data, _ = write_official(tmp_path / "data", per_batch=200, n_test=400)
    args = [*SHORT, "--epochs", "1", "--subset", "800", "--loader", "torch", "--quiet", "--data", str(data)]
    one = run_train([*args, "--out-dir", tmp_path / "torchrun"], launcher=torchrun())
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port()  # an sbatch script may export it; derived from the job id otherwise (above)
    tasks = [
        subprocess.Popen(
            [sys.executable, "-m", "fastcifar.train", *args, "--out-dir", str(tmp_path / "srun")],
            cwd=ROOT,
            env={**env(), **TASK, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        for t in tasks:
            _, err = t.communicate(timeout=300)
            assert t.returncode == 0, err[-3000:]
    finally:
        for t in tasks:
            if t.poll() is None:
                t.kill()
                t.communicate()

    epochs = []
    for out in (tmp_path / "srun", tmp_path / "torchrun"):
        s = summary_of(out)
        assert s["device"]["world_size"] == 2 and s["per_rank_batch"] == 50
        epochs.append(epochs_of(s))
    assert epochs[0] == epochs[1]
