"""Stopping cleanly on SIGINT and SIGTERM: one line, exit 128 + the signal, nothing half-written.

Python's default turns SIGINT into a KeyboardInterrupt whose traceback runs 30-70 lines through
decode, DALI or the step, and SIGTERM kills the process before any ``finally`` runs (the decode
cache's ``.tmp`` file stayed beside the data). ``install`` makes both raise ``Interrupted`` in
the main thread instead: ``finally`` blocks run (temporary files are removed, logs closed), and
the trainer's ``main`` prints one line and returns ``exit_code``. A second signal while stopping
is ignored, so the clean-up is not itself interrupted. ``restore`` puts the caller's handlers
back when ``main`` returns.
"""

from __future__ import annotations

import signal
import threading


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
_stopping = False


def _handler(signum, frame):
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise Interrupted(signum)


def install() -> dict:
    """Route SIGINT and SIGTERM to ``Interrupted``; a no-op outside the main thread (where Python
    cannot set handlers, e.g. a test calling ``main`` from a worker thread). Returns the handlers
    it replaced, for ``restore``: a caller in a longer-lived process (pytest, a notebook) gets its
    own Ctrl-C back after the run."""
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        return {}
    _stopping = False
    return {sig: signal.signal(sig, _handler) for sig in HANDLED}


def restore(previous: dict) -> None:
    """Put back the handlers ``install`` replaced (nothing when it replaced none)."""
    for sig, handler in previous.items():
        if handler is not None:  # None: set outside Python, which signal.signal cannot put back
            signal.signal(sig, handler)
