"""tests/helpers/forkserver.py: a command forked from the server ends as the same command run by
subprocess.run does (its output, its exit status, what it sees), and anything the server cannot
start as a fresh interpreter would goes to subprocess.run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
from cli import ROOT, env

SHOW = (
    "import os, sys, json\n"
    "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'path0': sys.path[0], 'name': __name__,\n"
    "                  'var': os.environ.get('FORK_TEST_VAR'), 'stdin': sys.stdin.read()}))\n"
    "print('to stderr', file=sys.stderr)\n"
    "raise SystemExit(int(sys.argv[-1]))\n"
)


def both(argv, e=None, cwd=ROOT):
    e = e or env()
    plain = subprocess.run(argv, env=e, cwd=cwd, capture_output=True, text=True, timeout=120)
    return forkserver.run(argv, env=e, cwd=cwd, timeout=120, capture_output=True, text=True), plain


def fork(argv, e=None, **kwargs):
    return forkserver.run(argv, env=e or env(), cwd=ROOT, capture_output=True, text=True, **kwargs)


def same(forked, plain):
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)


@pytest.fixture(scope="module", autouse=True)
def own_server():
    """A server of this file's own, started in this environment: the process's server may have been
    started before an earlier test changed the environment in a way that sends commands to the
    fallback (which the tests below would rightly report)."""
    kept, forkserver._server = forkserver._server, None
    yield
    if forkserver._server is not None:
        forkserver._stop(forkserver._server[0], str(Path(forkserver._server[1]).parent))
    forkserver._server = kept


@pytest.fixture
def served(monkeypatch):
    """A command sent to the server, not to subprocess.run (a test that the fork ran, not the fallback)."""
    monkeypatch.delenv("FASTCIFAR_TEST_FORK", raising=False)
    calls = []
    real = subprocess.run
    monkeypatch.setattr(forkserver.subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    yield
    assert not calls, f"went to subprocess.run: {calls}"


@pytest.mark.parametrize("status", [0, 3])
def test_code_script_and_module_see_what_a_fresh_interpreter_gives_them(tmp_path, status, monkeypatch):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    (tmp_path / "show_mod.py").write_text(SHOW)
    e = env()
    for argv in (
        [sys.executable, "-c", SHOW, "a b", str(status)],
        [sys.executable, str(script), "x", str(status)],
    ):
        forked, plain = both(argv, e, cwd=tmp_path)
        same(forked, plain)
        assert forked.returncode == status and forked.stderr == "to stderr\n"
    # -m: the module from the working folder (sys.path[0]), run as __main__
    forked, plain = both([sys.executable, "-m", "show_mod", "y", str(status)], e, cwd=tmp_path)
    same(forked, plain)
    assert '"name": "__main__"' in forked.stdout and f'"path0": "{tmp_path}"' in forked.stdout


def test_the_commands_were_forked_not_run(tmp_path, served):
    """The server answers: a command with the server's environment never reaches subprocess.run."""
    out = fork([sys.executable, "-c", "import sys; print(sys.orig_argv[1:])", "z"])
    assert out.returncode == 0 and out.stdout == "['-c', 'import sys; print(sys.orig_argv[1:])', 'z']\n", out


def test_exceptions_and_exits_end_as_the_interpreter_ends(tmp_path, served):
    cases = {
        "raise ValueError('boom')": (1, "ValueError: boom"),
        "raise SystemExit('a message')": (1, "a message"),
        "raise SystemExit": (0, ""),
        "raise KeyboardInterrupt": (-2, "KeyboardInterrupt"),
        "import os; os._exit(7)": (7, ""),
        "import sys; sys.exit(-1)": (255, ""),
        "import atexit; atexit.register(print, 'at exit')": (0, ""),
    }
    for code, (status, err) in cases.items():
        out = fork([sys.executable, "-c", code])
        assert out.returncode == status and err in out.stderr, (code, out)
        if "atexit" in code:
            assert out.stdout == "at exit\n"


def test_a_package_run_with_m_keeps_its_submodules(served):
    """``python -m fastcifar`` runs the package's __main__ with the package as imported (only a
    module is unimported first, for runpy's sake): its subcommands find their modules."""
    forked = fork([sys.executable, "-m", "fastcifar", "predict", "--help"])
    assert forked.returncode == 0 and forked.stderr == "", forked.stderr
    assert forked.stdout.startswith("usage: python -m fastcifar predict"), forked.stdout[:200]


def test_the_trainers_help_is_the_same_and_nothing_warns(served):
    forked = fork([sys.executable, "-m", "fastcifar.train", "--help"])
    assert forked.returncode == 0 and forked.stderr == "", forked.stderr  # runpy: no "found in sys.modules"
    assert forked.stdout.startswith("usage: python -m fastcifar.train"), forked.stdout[:200]


def test_another_environment_or_interpreter_option_runs_as_a_subprocess(monkeypatch):
    """What the import could see differently goes to subprocess.run: another environment (here one
    variable more) and an interpreter option; PYTEST_CURRENT_TEST may differ."""
    fork([sys.executable, "-c", "pass"])  # the server is up
    calls = []
    real = subprocess.run
    monkeypatch.setattr(forkserver.subprocess, "run", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    code = "import os; print(os.environ.get('FORK_TEST_VAR'))"
    out = fork([sys.executable, "-c", code], {**env(), "FORK_TEST_VAR": "1"})
    assert out.stdout == "1\n" and len(calls) == 1
    out = fork([sys.executable, "-I", "-c", "print(2)"])
    assert out.stdout == "2\n" and len(calls) == 2
    out = fork([sys.executable, "-c", "print(3)"], {**env(), "PYTEST_CURRENT_TEST": "x"})
    assert out.stdout == "3\n" and len(calls) == 2


def test_a_command_past_its_timeout_is_killed(served):
    with pytest.raises(subprocess.TimeoutExpired):
        fork([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_the_client_stands_for_the_interpreter_of_a_rank(tmp_path):
    """torchrun's ranks: the client's command runs forked with the client's stdout and a rank's
    variables; another environment runs the interpreter itself, with the same result."""
    (client,) = forkserver.client()
    code = "import os, sys; print(os.environ.get('RANK'), os.environ.get('OTHER'), sys.argv[1:]); sys.exit(4)"
    for extra in ({"RANK": "1"}, {"RANK": "1", "OTHER": "x"}):
        with open(tmp_path / "out", "w+") as out:
            proc = subprocess.run([client, "-c", code, "a"], env={**env(), **extra}, cwd=ROOT, stdout=out, timeout=60)
            out.seek(0)
            assert proc.returncode == 4 and out.read() == f"1 {extra.get('OTHER')} ['a']\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_client_ends_its_child(tmp_path, sig):
    """A launcher's SIGTERM is forwarded (the child ends by it, and so does the client); a SIGKILL
    cannot be, and the child dies with the client: no rank outlives what its launcher killed."""
    (client,) = forkserver.client()
    code = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"
    proc = subprocess.Popen([client, "-c", code], env=env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid  # forked by the server, not the client itself
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == -sig
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") and "Z" not in state(child):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or "Z" in state(child), f"the child {child} outlived the client"


def state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_popen_gives_the_commands_own_pid_to_signal(tmp_path):
    """A test that stops or kills a rank signals the command itself: SIGSTOP stops it, SIGKILL ends
    it with -9, and its output goes to the file given."""
    with open(tmp_path / "out", "w") as out:
        proc = forkserver.popen(
            [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
            env=env(),
            cwd=ROOT,
            stdout=out,
        )
    assert isinstance(proc, forkserver.Forked)
    deadline = time.monotonic() + 60
    while not (tmp_path / "out").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int((tmp_path / "out").read_text()) == proc.pid
    proc.send_signal(signal.SIGSTOP)
    while state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(proc.pid) == "T" and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    proc.kill()  # after the end: nothing (the pid may be another process's by now)


def test_what_a_command_starts_with_sys_executable_is_forked_too():
    """A sweep's workers, a bench's runs and torchrun's ranks are started by the command itself,
    with sys.executable: the client, so they are forked by the server as well (their parent is the
    server, as the command's is), or, in another environment, the interpreter (the command's child)."""
    code = (
        "import os, subprocess, sys\n"
        "show = [sys.executable, '-u', '-c', 'import os; print(os.getppid())']\n"
        "same = subprocess.run(show, capture_output=True, text=True).stdout.split()\n"
        "os.environ['X_OTHER'] = '1'\n"
        "other = subprocess.run(show, capture_output=True, text=True).stdout.split()\n"
        "print(os.getpid(), os.getppid(), *same, *other)\n"
    )
    out = fork([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    pid, server, same, other = out.stdout.split()
    assert same == server and other == pid, out.stdout


def test_the_server_outlives_a_requester_that_goes_and_a_dead_server_is_replaced(served):
    """A request cut short, and one whose sender is gone before the reply (a client killed at its
    start), leave the server serving; a server that ended is started again on the next command."""
    import json
    import socket
    import struct

    proc, path, _ = forkserver._running_server()
    cut = forkserver._connect(path, proc)
    cut.sendall(struct.pack("!I", 1000) + b"{")  # promised 1000 bytes, sent one
    cut.close()
    gone = forkserver._connect(path, proc)
    body = json.dumps({"argv": ["-c", "pass"], "env": env(), "cwd": str(ROOT)}).encode()
    with open(os.devnull) as null:
        socket.send_fds(gone, [struct.pack("!I", len(body))], [null.fileno()] * 3)
    gone.sendall(body)
    gone.close()
    assert fork([sys.executable, "-c", "print(1)"]).stdout == "1\n"
    assert proc.poll() is None, "the server ended"
    proc.kill()
    proc.wait()
    assert fork([sys.executable, "-c", "print(2)"]).stdout == "2\n"
    assert forkserver._server[0] is not proc
