"""bench.common.git_commit: figures measured on uncommitted code say so in their commit field."""

from __future__ import annotations

import subprocess

from bench.common import git_commit


def git(cwd, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_commit_is_marked_dirty_only_when_tracked_files_changed(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "kernel.py").write_text("TILE = 2048\n")
    git(tmp_path, "add", "kernel.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not change what ran\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("TILE = 4096\n")
    assert git_commit(tmp_path) == head + "+dirty"


def test_outside_a_checkout_there_is_no_commit(tmp_path):
    assert git_commit(tmp_path) == ""
