"""Stopping cleanly on SIGINT and SIGTERM: one line, exit 128 + the signal, nothing half-written.

Python's default turns SIGINT into a KeyboardInterrupt whose traceback runs 30-70 lines through
decode, DALI or the step, and SIGTERM kills the process before any ``finally`` runs (the decode
cache's ``.tmp`` file stayed beside the data). ``install`` makes both raise ``Interrupted`` in
the main thread instead: ``finally`` blocks run (temporary files are removed, logs closed), and
the trainer's ``main`` prints one line and returns ``exit_code``. A second signal while stopping
is ignored, so the clean-up is not itself interrupted. ``restore`` puts the caller's handlers
back when ``main`` returns.

A Python handler only runs in the main thread, between bytecodes: while the main thread is blocked
in C++ (a collective waiting for a dead or stopped peer, a CUDA synchronize behind it), a SIGTERM
waits with it, and torchrun's SIGKILL 30 s later leaves no record. So ``install`` also has the
signal's number written to a pipe (``signal.set_wakeup_fd``: CPython's C-level handler writes it
from whichever thread the signal lands on) and a watcher thread reads it. If the main thread has
not taken the signal within ``HANDLER_WAIT_S``, or has not ended the process within
``STOP_TIMEOUT_S``, the watcher calls ``on_blocked(Interrupted(signum))`` (the trainer records
the stop in log.txt and summary.json and prints its line) and ends the process with the same
status the main thread would have: 128 + the signal.

Several threads may end a distributed rank: the main thread's error handling, the progress
watchdog (parallel/distributed.py) and this watcher. ``claim_ending`` lets exactly one of them speak,
record and choose the exit status; the others stay silent and leave the exit to it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fastcifar.core.environment import launcher_rank


class StopRun(BaseException):
    """Ends the run early on purpose, with one line and its own exit code. A BaseException, like
    KeyboardInterrupt, so the ``except Exception`` blocks of the data layer do not swallow it."""

    exit_code = 1


class Interrupted(StopRun):
    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


HANDLED = (signal.SIGINT, signal.SIGTERM)
# The main thread returns to Python between steps, batches and decode chunks, many times a second:
# 5 s without its handler running means it is blocked in C++ and cannot take the signal.
HANDLER_WAIT_S = 5.0
# From the signal to the end of the process when the main thread did take it: its finally blocks,
# the record and the process group's teardown (bounded at 5 s, parallel/distributed.py) take seconds.
# With RECORD_TIMEOUT_S this stays inside the 30 s torchrun waits between its SIGTERM and its
# SIGKILL (torch/distributed/elastic/multiprocessing/api.py, close(timeout=30)).
STOP_TIMEOUT_S = 15.0
# How long the watcher lets ``on_blocked`` record before it ends the process regardless: a few
# small local writes, but the disk may itself be what hangs.
RECORD_TIMEOUT_S = 10.0

_stopping = False
_importing = 0  # depth of ``held`` blocks in the main thread
_held_signum: int | None = None  # the signal that came during one, taken when the outermost ends
_handled = threading.Event()  # the main thread's handler ran: it is stopping the run itself
_ending = threading.Lock()
_watcher: _Watcher | None = None


def _early(signum, frame):
    """Before a command's ``main`` installs ``_handler``: the process is still importing (torch
    takes seconds), has written nothing, and the import cannot be unwound without runpy's
    traceback, so the one line and the exit status come at once."""
    if _hold(signum):
        return
    if launcher_rank() == "0":
        try:
            os.write(2, f"fastcifar: interrupted by {signal.Signals(signum).name}\n".encode())
        except OSError:
            pass
    os._exit(128 + signum)


def install_early() -> None:
    """For ``python -m fastcifar...`` and the console scripts, from the package's import: SIGINT
    and SIGTERM end the process with one line until ``install`` takes over (a no-op outside the
    main thread, and for a signal the parent set to be ignored, as ``nohup`` does)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(sig, _early)


def _hold(signum: int) -> bool:
    """Inside ``held``: note the signal for its end and return True (the handler then does nothing
    more). The main thread has taken the signal, so the watcher waits for its stop, not the
    blocked-thread timeout."""
    global _held_signum
    if not _importing:
        return False
    if _held_signum is None:
        _held_signum = signum
    _handled.set()
    return True


@contextmanager
def held() -> Iterator[None]:
    """Around an import that loads an extension module (onnx, onnxruntime, tensorboard, DALI): a
    SIGINT or SIGTERM that comes meanwhile is taken when the import is over, not inside it. The
    handler would otherwise raise in the middle of the extension's initialization: onnx's nanobind
    module then aborted or crashed (exit 134, 139), and onnxruntime's pybind11 module turned the
    interruption into an ImportError, reported as a package that cannot be imported (exit 2).
    A Python handler cannot leave the stop for later itself without this flag: blocking the signals
    (``pthread_sigmask``) holds them in the main thread only, and the process-directed signal then
    lands on another thread, whose C handler still has the main thread run the Python one."""
    global _importing, _held_signum
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _importing += 1
    try:
        yield
    finally:
        _importing -= 1
        if not _importing and _held_signum is not None:
            signum, _held_signum = _held_signum, None
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, None)  # ``_handler`` raises Interrupted here; ``_early`` ends the process


def _handler(signum, frame):
    global _stopping
    if _stopping or _hold(signum):
        return
    _stopping = True
    _handled.set()
    raise Interrupted(signum)


# ``fastcifar predict ... | head -1``: the reader is gone. A shell reports a process that SIGPIPE
# ended as 128 + 13; Python ignores SIGPIPE and raises BrokenPipeError instead, with a traceback,
# and again at exit when it flushes stdout. The commands end quietly with the shell's status.
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


def stdout_gone() -> int:
    """Point stdout at /dev/null (the interpreter's last flush then has nowhere to fail) and
    return ``BROKEN_PIPE_EXIT``."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return BROKEN_PIPE_EXIT


def claim_ending() -> bool:
    """True for the first thread to end this process; it prints the one line, records the cause
    and picks the exit status. False for any later one: it stays silent and leaves the exit to the
    first (which always ends the process, see ``wait_for_claimant``)."""
    return _ending.acquire(blocking=False)


def wait_for_claimant() -> None:
    """The main thread lost ``claim_ending`` to a watcher thread, which records and then ends the
    process with ``os._exit``: wait for that, so the exit status is the one the record gives."""
    time.sleep(RECORD_TIMEOUT_S + 5.0)


def end_run(exc: StopRun, say: Callable[[StopRun], None]) -> int:
    """The main thread's end of what ``exc`` stopped: ``say(exc)`` (its one line, the trainer's
    record too) and its exit status. When a watcher thread claimed the end first, it speaks and ends
    the process: wait for that (``wait_for_claimant``), and say it here only should it not."""
    if not claim_ending():
        wait_for_claimant()
    say(exc)
    return exc.exit_code


def exit_now(code: int, exc: BaseException | None = None) -> None:
    """End the process at once with ``code`` (no finally blocks, no interpreter shut-down, which can
    block on the same stuck collective): what is buffered on stdout and stderr is written first, and
    the traceback of ``exc`` when it is an unexpected error (exit 1)."""
    if exc is not None and not isinstance(exc, (StopRun, SystemExit)):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def call_bounded(fn: Callable, arg, timeout_s: float) -> None:
    """``fn(arg)`` in a thread of its own, waited on for at most ``timeout_s``; errors are dropped
    (best effort: the caller ends the process either way)."""

    def call():
        try:
            fn(arg)
        except BaseException:
            pass

    t = threading.Thread(target=call, name="fastcifar-record", daemon=True)
    t.start()
    t.join(timeout_s)


class _Watcher:
    """Reads the signal numbers CPython writes to the wakeup pipe and ends a process whose main
    thread cannot take them (the module docstring)."""

    def __init__(self, on_blocked: Callable[[Interrupted], None] | None):
        self.on_blocked = on_blocked
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd requires it: a signal handler never blocks
        self.previous_fd = signal.set_wakeup_fd(self.write_fd)
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="fastcifar-signals", daemon=True).start()

    def _run(self) -> None:
        try:
            while not self.closed.is_set():
                data = os.read(self.read_fd, 64)
                if self.closed.is_set() or not data:
                    return
                signums = [n for n in data if n in HANDLED]
                if signums:
                    self._stop(Interrupted(signums[0]))
                    return
        except OSError:
            return
        finally:
            os.close(self.read_fd)

    def _stop(self, exc: Interrupted) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        handled = _handled.wait(HANDLER_WAIT_S)
        if handled and self.closed.wait(max(0.0, deadline - time.monotonic())):
            return  # the main thread took the signal and finished
        if self.closed.is_set():
            return
        # The main thread is blocked (its handler never ran) or stuck in its clean-up.
        if claim_ending():
            if self.on_blocked is not None:
                call_bounded(self.on_blocked, exc, RECORD_TIMEOUT_S)
            exit_now(exc.exit_code)
        # Another thread claimed the end (the progress watchdog, the main thread's error handling):
        # it exits after its own record; should it hang, this ends the process all the same.
        if not self.closed.wait(RECORD_TIMEOUT_S + 5.0):
            exit_now(exc.exit_code)

    def close(self) -> None:
        self.closed.set()
        signal.set_wakeup_fd(self.previous_fd)
        try:
            os.write(self.write_fd, b"\0")  # wakes the reader, which sees ``closed`` and returns
        except OSError:
            pass
        os.close(self.write_fd)


def new_run() -> None:
    """A new run in this process starts with the end unclaimed: ``install`` does it for the command
    line; ``fastcifar.api.train``, which installs no handlers, calls this, or after a ``main`` that
    claimed the end (pytest, a notebook) its watchdog could never claim it and a stalled peer would
    hang the run."""
    global _ending
    _ending = threading.Lock()


def _forget_in_child() -> None:
    """A child forked without exec inherits the wakeup fd: a SIGTERM sent to it (a worker being
    stopped) would write into the parent's pipe and end a healthy parent. It gets none."""
    if _watcher is not None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the child's main thread
            pass


os.register_at_fork(after_in_child=_forget_in_child)


def install(on_blocked: Callable[[Interrupted], None] | None = None) -> dict:
    """Route SIGINT and SIGTERM to ``Interrupted``, and start the watcher that ends the process
    through ``on_blocked`` when the main thread cannot take them; a no-op outside the main thread
    (where Python cannot set handlers, e.g. a test calling ``main`` from a worker thread). Returns
    the handlers it replaced, for ``restore``: a caller in a longer-lived process (pytest, a
    notebook) gets its own Ctrl-C back after the run."""
    global _stopping, _watcher
    new_run()  # a new run in the same process (pytest calling ``main``) starts unclaimed
    if threading.current_thread() is not threading.main_thread():
        return {}
    _stopping = False
    _handled.clear()
    previous = {sig: signal.signal(sig, _handler) for sig in HANDLED}
    if _watcher is not None:
        _watcher.close()
    _watcher = _Watcher(on_blocked)
    return previous


def restore(previous: dict) -> None:
    """Put back the handlers ``install`` replaced (nothing when it replaced none) and stop the
    watcher: the run is over, nothing is left for it to end. The end stays claimed: the progress
    watchdog may still be running until the process exits, and must stay silent (``new_run``)."""
    global _watcher
    if _watcher is not None and previous and threading.current_thread() is threading.main_thread():
        _watcher.close()
        _watcher = None
    for sig, handler in previous.items():
        if handler is not None:  # None: set outside Python, which signal.signal cannot put back
            signal.signal(sig, handler)
