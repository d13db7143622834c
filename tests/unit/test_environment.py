"""The environment variables fastcifar reads (fastcifar/core/environment.py): here, a Slurm job
array's task (the thread variables' checks are tested with the commands that refuse them), and the
cores a process may use."""

from __future__ import annotations

import os

import pytest

from fastcifar.core.environment import slurm_array_task, usable_cores, visible_gpu_names


def test_a_slurm_array_task_counts_from_its_first_index():
    assert slurm_array_task({}) is None
    assert slurm_array_task({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}) == (3, 4)
    env = {"SLURM_ARRAY_TASK_ID": "64", "SLURM_ARRAY_TASK_COUNT": "64", "SLURM_ARRAY_TASK_MIN": "1"}
    assert slurm_array_task(env) == (63, 64)  # --array=1-64


@pytest.mark.parametrize(
    "env, says",
    [
        ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"}, "is not one of SLURM_ARRAY_TASK_COUNT 4"),
        ({"SLURM_ARRAY_TASK_ID": "0"}, "SLURM_ARRAY_TASK_COUNT must be a whole number, not ''"),
        ({"SLURM_ARRAY_TASK_ID": "a", "SLURM_ARRAY_TASK_COUNT": "4"}, "SLURM_ARRAY_TASK_ID must be a whole number"),
        (
            {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "2"},
            "SLURM_ARRAY_TASK_ID 0 (from 2)",
        ),
        ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "0"}, "is not one of"),
    ],
)
def test_values_that_cannot_be_are_one_line(env, says):
    with pytest.raises(ValueError) as err:
        slurm_array_task(env)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_childs_gpu_is_named_as_this_process_sees_it():
    assert visible_gpu_names(2, {}) == ["0", "1"]
    assert visible_gpu_names(2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]  # Slurm gave this task GPUs 2 and 3
    assert visible_gpu_names(1, {"CUDA_VISIBLE_DEVICES": "GPU-8a1f, GPU-77c2"}) == ["GPU-8a1f"]
    assert visible_gpu_names(0, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_usable_cores_are_the_affinity_where_there_is_one_else_every_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    assert usable_cores() == 2  # taskset -c 0,3
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores() == 6
