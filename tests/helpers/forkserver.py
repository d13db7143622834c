"""A Python command started by fork from a process that has already imported torch and fastcifar.

Most of the suite's time was interpreters starting: a trainer subprocess spent about 4.4 s of CPU
importing torch, Triton and fastcifar before a SHORT run's 1.6 s of training (2 cores, 2026-12-07).
``run`` gives what ``subprocess.run(argv, env=, cwd=, timeout=, capture_output=True, text=True)``
gives, and ``popen`` what ``subprocess.Popen(argv, env=, cwd=, stdout=FILE, stderr=FILE)`` gives
(a ``Forked`` whose pid is the command's own), for ``argv`` = [sys.executable, "-m" MODULE | "-c"
CODE | SCRIPT, args...], from a child forked off a server that imported those modules once (one
server per test process, started on first use). ``client()`` stands for sys.executable where the
command is started by another program (torchrun's ranks), and is the child's sys.executable, so
that what a command starts in turn (a sweep's workers, a bench's runs) is forked as well.

What a child does not repeat is the import, so a command is forked only where the import's result
cannot differ from a fresh interpreter's: the same environment as the server's (``MAY_DIFFER``
aside: variables read when a run uses them), hence the same PYTHONPATH, OMP_NUM_THREADS and
TRITON_INTERPRET, and no interpreter option but ``-u``. The rest (another environment, another
executable, a pipe for its output, a test about the interpreter's start or imports) runs as
before; so does everything when ``FASTCIFAR_TEST_FORK=0``, and ``FASTCIFAR_TEST_FORK_LOG=FILE``
lists what was not forked, and why. The child is otherwise a fresh command: its own argv,
environment, working folder, stdin from /dev/null, its stdout and stderr, signals at an
interpreter's defaults, the module run as ``__main__`` by runpy as ``python -m`` does, atexit
handlers run, the exit status of ``SystemExit`` or of an uncaught exception, and fastcifar's start
for a command (the package's import ran in the server, where it was no command).
tests/harness/test_forkserver.py holds each of these against a real subprocess.

Where a forked command is not a fresh one: every child shares the server's string-hash seed (so
the tests that compare ranks bit for bit set FASTCIFAR_TEST_FORK=0); a program that starts the
client sees the client's pid, not the command's (a sweep launcher names its workers by the pid it
started, a worker itself by its own: under a forked launcher a dead worker's run comes back when
its lease ends, not at once); a warning the imports print goes to the server's stderr.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Variables a child may have that the server did not, each read when a run uses it, not at import:
# pytest's name of the running test; torchrun's and Slurm's rank, place and rendezvous (read when
# the process group starts); cuBLAS's workspace, NCCL's settings and Triton's cache folder, which
# the trainer sets for itself, and two of Inductor's, which torch.compile sets (a test that
# trains or compiles in-process leaves them in its process's environment, and so in every later
# command's; FASTCIFAR_TEST_FORK_LOG=FILE lists what was not forked, and why).
MAY_DIFFER = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
        *("ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
        *("NCCL_ASYNC_ERROR_HANDLING", "CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "TRITON_HOME"),
        *("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"),
    }
)
MAY_DIFFER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "SLURM_")
# Imported by the server: what a trainer, a sweep or a bench script spends its start on.
PRELOAD = ("torch", "numpy", "triton", "fastcifar.train", "fastcifar.sweep.cli", "bench.common")

# The environment the server imports in: tests/helpers/cli.py sets it to its env() as it is
# imported, at collection, before any test has changed this process's environment.
BASE_ENV: dict[str, str] = {}
_server: tuple[subprocess.Popen, str, dict] | None = None


def _without_u(argv: list[str]) -> list[str]:
    """``-u`` dropped: the server's environment has PYTHONUNBUFFERED=1 (cli.env), the same thing."""
    return argv[:1] + argv[2:] if argv[1:2] == ["-u"] else argv


def _forkable(argv: list[str]) -> bool:
    argv = _without_u(argv)
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    first = argv[1]
    if first in ("-m", "-c"):
        return len(argv) >= 3
    return not first.startswith("-")


def _start(env: dict) -> tuple[subprocess.Popen, str, dict]:
    # in /tmp where there is one: a long TMPDIR would pass the 107 bytes of a socket's path
    folder = tempfile.mkdtemp(prefix="fastcifar-fork-", dir="/tmp" if os.path.isdir("/tmp") else None)
    path = os.path.join(folder, "socket")
    proc = subprocess.Popen(
        [sys.executable, __file__, path],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(folder, "server.err"), "w"),
    )
    atexit.register(_stop, proc, folder)
    return proc, path, env


def _stop(proc: subprocess.Popen, folder: str) -> None:
    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _connect(path: str, proc: subprocess.Popen) -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if proc.poll() is not None:
                err = Path(path).with_name("server.err").read_text()[-3000:]
                raise RuntimeError(f"the fork server ended (exit {proc.returncode}):\n{err}") from None
            time.sleep(0.05)


def _differing(a: dict, b: dict) -> list[str]:
    """The variables, ``MAY_DIFFER`` aside, whose values two environments do not share."""
    keys = {k for k in set(a) | set(b) if k not in MAY_DIFFER and not k.startswith(MAY_DIFFER_PREFIXES)}
    return sorted(k for k in keys if a.get(k) != b.get(k))


class Forked:
    """A command forked by the server, as ``subprocess.Popen`` gives it to a test: ``pid`` (the
    command's own: a signal reaches it directly), ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``, ``returncode``, ``args``."""

    def __init__(self, args: list[str], sock: socket.socket):
        self.args, self._sock, self._buffer, self.returncode = args, sock, b"", None
        pid = self._line(60.0)  # the server forks at once; a minute is a server that is stuck
        if pid is None:
            raise RuntimeError("the fork server did not start the command within 60 s")
        self.pid = int(pid)

    def _line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._sock], [], [], left)[0]:
                return None
            chunk = self._sock.recv(64)
            if not chunk:
                raise RuntimeError("the fork server ended during a command")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self._line(timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(status)
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the server, so the pid is still this command's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running_server() -> tuple[subprocess.Popen, str, dict]:
    global _server
    if _server is None or _server[0].poll() is not None:  # none yet, or it ended: a new one
        _server = _start({k: v for k, v in (BASE_ENV or os.environ).items() if k not in MAY_DIFFER})
    return _server


def _server_for(argv: list[str], env: dict) -> tuple[subprocess.Popen, str, dict] | None:
    """The server that can start ``argv`` in ``env`` as a fresh interpreter would, or None."""
    if os.environ.get("FASTCIFAR_TEST_FORK") == "0" or not _forkable(argv):
        return None
    server = _running_server()
    differ = _differing(env, server[2])
    if not differ:
        return server
    if os.environ.get("FASTCIFAR_TEST_FORK_LOG"):  # why a command was not forked: the variables
        with open(os.environ["FASTCIFAR_TEST_FORK_LOG"], "a") as log:
            print(os.environ.get("PYTEST_CURRENT_TEST"), argv[1:3], differ, file=log)
    return None


def popen(argv, *, env: dict | None = None, cwd=None, stdout=None, stderr=None):
    """``subprocess.Popen(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr)``, forked from the
    server where that gives the same command (the module's docstring; stdin is /dev/null), else
    that Popen. ``stdout`` and ``stderr``: a file, or None for this process's own."""
    argv = [str(a) for a in argv]
    env = dict(os.environ) if env is None else env
    cwd = os.getcwd() if cwd is None else cwd
    server = _server_for(argv, env)
    if server is None or not all(f is None or isinstance(f, int) or hasattr(f, "fileno") for f in (stdout, stderr)):
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    proc, path, _ = server
    request = json.dumps({"argv": argv[1:], "env": env, "cwd": str(cwd)}).encode()
    sock = _connect(path, proc)
    with open(os.devnull) as null:
        fds = [null.fileno()]
        for f, own in ((stdout, 1), (stderr, 2)):  # None: this process's own, as Popen leaves it
            fds.append(own if f is None else f if isinstance(f, int) else f.fileno())
        socket.send_fds(sock, [struct.pack("!I", len(request))], fds)
        sock.sendall(request)
        return Forked(argv, sock)


def run(
    argv, *, env: dict | None = None, cwd=None, timeout: float | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, env=env, cwd=cwd, timeout=timeout, **kwargs)``, forked from the server
    where that gives the same result (the module's docstring): for ``capture_output=True,
    text=True`` and nothing else in ``kwargs``. As subprocess.run does, it reads the output to its
    end (a process the command left behind holding it keeps it waiting) and decodes it as text."""
    argv = [str(a) for a in argv]
    env = dict(os.environ) if env is None else env
    if kwargs != {"capture_output": True, "text": True} or _server_for(argv, env) is None:
        return subprocess.run(argv, env=env, cwd=cwd, timeout=timeout, **kwargs)
    deadline = None if timeout is None else time.monotonic() + timeout
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        proc = popen(argv, env=env, cwd=cwd, stdout=out_w, stderr=err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    read, reading = {out_r: [], err_r: []}, [out_r, err_r]
    try:
        while reading:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(reading, [], [], left)[0]
            if not ready:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                read[fd].append(chunk)
                if not chunk:
                    reading.remove(fd)
        try:
            proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    finally:
        os.close(out_r)
        os.close(err_r)
    encoding = locale.getpreferredencoding(False)

    def text(fd: int) -> str:  # as Popen's text mode: the locale's encoding, universal newlines
        return b"".join(read[fd]).decode(encoding).replace("\r\n", "\n").replace("\r", "\n")

    return subprocess.CompletedProcess(argv, proc.returncode, text(out_r), text(err_r))


def client() -> list[str]:
    """A command that stands for ``sys.executable`` where a test cannot call ``run``: the ranks
    torchrun starts (``torchrun --no-python CLIENT -m fastcifar.train``). The client, a Python
    without site (about 20 ms), sends its argv, environment, working folder and stdin, stdout and
    stderr to the server; the forked child runs the command. The client forwards the signals a
    launcher sends (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2), ends with the child's status, and
    the child dies with the client (a SIGKILL cannot be forwarded). Where the server could not start
    the command as a fresh interpreter (another environment than the server's, torchrun's rank
    variables aside), the client execs the interpreter itself."""
    if os.environ.get("FASTCIFAR_TEST_FORK") == "0":
        return [sys.executable, "-u"]
    proc, path, _ = _running_server()
    _connect(path, proc).close()  # the server is listening, so the client file is written
    return [str(Path(path).with_name("python"))]


# What client() writes beside the socket, with SOCKET and PYTHON filled in.
CLIENT = """
import json, os, signal, socket, struct, sys
FORWARDED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
# held until the command's pid is known, then forwarded: a launcher's SIGTERM that comes first
# is not lost (nor turned into the SIGKILL the command would get by the client's death)
signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
argv = sys.argv[1:]
request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "watch": os.getpid()}).encode()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(SOCKET)
socket.send_fds(sock, [struct.pack("!I", len(request))], [0, 1, 2])
sock.sendall(request)
replies = sock.makefile("r")
first = replies.readline().strip()
if first == "exec":  # the interpreter itself, with the signals as they came (exec keeps the mask)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.execv(PYTHON, [PYTHON, *argv])
pid = int(first)


def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


for sig in FORWARDED:
    signal.signal(sig, forward)
signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
status = replies.readline()
if not status:
    sys.exit("fork client: the fork server ended during the command")
status = int(status)
if status < 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    signal.signal(-status, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {-status})
    os.kill(os.getpid(), -status)
sys.exit(status)
"""


# ---- the server (this file run as a script) ----


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF  # as the interpreter's: sys.exit(-1) is 255
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict, fds: list[int]) -> None:
    """Become the command, then leave with its status (never returns, whatever happens)."""
    code, by_signal = 1, None
    try:
        code, by_signal = _command(request, fds)
    except BaseException:  # before the command ran (a folder gone, the client gone): its traceback
        import traceback

        traceback.print_exc()
    finally:
        if by_signal is not None:  # as the interpreter ends after an uncaught KeyboardInterrupt
            signal.signal(by_signal, signal.SIG_DFL)
            os.kill(os.getpid(), by_signal)
        os._exit(code)


def _command(request: dict, fds: list[int]) -> tuple[int, int | None]:
    """The command's run in this (forked) process: (exit status, signal to end by or None)."""
    import atexit as child_atexit
    import runpy
    import threading
    import traceback
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("watch"):  # a client's child: it dies with the client (a SIGKILL is not forwarded)
        try:
            watched = os.pidfd_open(request["watch"])
        except ProcessLookupError:  # the client is gone already
            os.kill(os.getpid(), signal.SIGKILL)

        def die_with_the_client() -> None:
            select.select([watched], [], [])
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_with_the_client, daemon=True).start()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = _without_u([sys.executable, *request["argv"]])[1:]
    # what this command starts with sys.executable (a sweep's workers, a bench's runs, torchrun's
    # ranks) goes through the client: forked too where it can be, the interpreter where not
    sys.orig_argv = [sys.executable, *request["argv"]]
    sys.executable = str(Path(request["socket"]).with_name("python"))
    kind, target, args = ("script", argv[0], argv[1:]) if argv[0] not in ("-m", "-c") else (argv[0], argv[1], argv[2:])
    # sys.path[0] as the interpreter sets it: the script's folder, the working folder for -m, "" for -c
    sys.path[0] = {"script": os.path.dirname(os.path.abspath(target)), "-m": os.getcwd(), "-c": ""}[kind]
    code, by_signal = 0, None
    try:
        if kind == "-m":
            # runpy's own first step for `python -m`: sys.argv[0] is "-m" while the package imports
            sys.argv = ["-m", *args]
            import fastcifar

            fastcifar._start_command()  # what the package's import does for a command
            # a module (not a package: runpy runs its __main__) unimported, as a fresh interpreter
            # finds it (runpy warns otherwise)
            module = sys.modules.get(target)
            if module is not None and not hasattr(module, "__path__"):
                del sys.modules[target]
                if "." in target:
                    package, _, name = target.rpartition(".")
                    vars(sys.modules[package]).pop(name, None)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = _exit_status(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, by_signal = 1, signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    child_atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code, by_signal


def _serve(path: str) -> None:
    import importlib
    import traceback

    own = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    client = Path(path).with_name("python")  # see client(); the interpreter without site: ~20 ms
    client.write_text(
        f"#!{sys.executable} -S\n" + CLIENT.replace("SOCKET", repr(path)).replace("PYTHON", repr(sys.executable))
    )
    client.chmod(0o755)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}

    def reply(conn: socket.socket, text: str) -> None:
        try:
            conn.sendall(text.encode())
        except OSError:  # the one who asked is gone (a client killed meanwhile): nothing to tell
            pass

    def serve_one(conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            if len(head) < 4:  # client()'s probe: a connection and nothing sent
                conn.close()
                return
            (size,) = struct.unpack("!I", head)
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ConnectionError("the request ended early")
                body += chunk
            request = {**json.loads(body), "socket": path}
        except Exception:
            traceback.print_exc()
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        differ = _differing(request["env"], own)
        if differ or not _forkable([sys.executable, *request["argv"]]):  # the client runs the interpreter
            print("exec:", request["argv"][:2], "variables:", differ, file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            reply(conn, "exec\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in children.values():  # another command's end is the server's to report
                other.close()
            conn.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        reply(conn, f"{pid}\n")
        children[pid] = conn

    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.02 if children else 1.0)
        if ready:
            conn, _ = listener.accept()
            serve_one(conn)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                reply(conn, f"{os.waitstatus_to_exitcode(status)}\n")
                conn.close()


if __name__ == "__main__":
    sys.path[0] = str(ROOT)
    _serve(sys.argv[1])
