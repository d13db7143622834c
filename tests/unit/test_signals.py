"""fastcifar.core.signals: how a rank ends when a SIGTERM comes while its main thread is blocked (as a
collective waiting for a dead peer blocks it), proven with small subprocesses, without a GPU. The
same behaviour with two real gloo ranks is in tests/distributed/test_stall_record.py."""

from __future__ import annotations

import pytest
from cli import run_script
from conftest import one_line_error

from fastcifar.parallel import distributed

# The watcher's waits, shortened so that each case takes a second or two.
SHORT_WAITS = "signals.HANDLER_WAIT_S = 0.5; signals.STOP_TIMEOUT_S = 1.5\n"


def test_a_sigterm_the_main_thread_cannot_take_is_recorded_and_ends_the_process(tmp_path):
    """The main thread cannot run Python's handler (SIGTERM blocked in it, and asleep for 60 s,
    as a thread in a C++ collective cannot): the watcher records the stop through ``on_blocked``
    and ends the process with 143, as the main thread would have. The signal comes from another
    thread, half a second into the main thread's sleep: ``os.kill`` runs pending handlers before it
    returns, so a main thread that signalled itself ran the handler whenever the watcher thread's C
    handler tripped first (3 of 40 such processes beside three busy loops on 2 cores exited 1)."""
    code = (
        "import os, signal, sys, threading, time\n"
        "from fastcifar.core import signals\n" + SHORT_WAITS + "def record(exc):\n"
        "    open(sys.argv[1], 'w').write(f'{exc} {exc.exit_code}')\n"
        "    print(f'fastcifar: {exc}', file=sys.stderr, flush=True)\n"
        "signals.install(on_blocked=record)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"  # made after the block, so blocked too
        "time.sleep(60)\n"
    )
    record = tmp_path / "record"
    proc, took = run_script(code, record, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert record.read_text() == "interrupted by SIGTERM 143"
    assert one_line_error(proc.stderr) == "fastcifar: interrupted by SIGTERM"
    assert took < 30, "ended by the watcher, not by the end of the 60 s sleep"


def test_a_sigterm_whose_clean_up_hangs_still_ends_the_process(tmp_path):
    """The main thread takes the signal but its clean-up never ends (a finally block stuck on the
    GPU): the watcher ends the process after STOP_TIMEOUT_S, with the record and 143."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write(str(exc)))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except signals.Interrupted:\n"
        "    time.sleep(60)\n"
    )
    record = tmp_path / "record"
    proc, took = run_script(code, record, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert record.read_text() == "interrupted by SIGTERM"
    assert took < 30


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_sigterm_the_main_thread_handles_in_time_is_left_to_it(tmp_path):
    """The usual case: the handler runs, the main thread records and finishes, ``restore`` stops
    the watcher, which must neither record nor end the process."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "previous = signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write('watcher'))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except signals.Interrupted:\n"
        "    assert signals.claim_ending()\n"
        "signals.restore(previous)\n"
        "time.sleep(2.5)\n"  # past the watcher's waits: it would have ended the process by now
        "print('still here')\n"
    )
    record = tmp_path / "record"
    proc, _ = run_script(code, record, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here", proc.stderr
    assert not record.exists()


def test_the_end_stays_claimed_after_restore_and_a_new_api_run_unclaims_it(monkeypatch):
    """After ``main`` claimed the end and restored the handlers, the progress watchdog (still alive
    until the process exits) must stay silent: one line, not two. ``fastcifar.api.train`` installs
    no handlers, so it unclaims the end itself, or a stalled peer would leave its watchdog unable
    to end the rank."""
    from fastcifar import api
    from fastcifar.core import signals
    from fastcifar.core.config import Config

    previous = signals.install()
    assert signals.claim_ending()
    signals.restore(previous)
    assert not signals.claim_ending()  # restore leaves it claimed
    monkeypatch.setattr(distributed, "setup", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        api.train(Config())
    assert signals.claim_ending()  # api.train began a new run: unclaimed
    signals.new_run()


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_forked_child_does_not_signal_through_the_parents_wakeup_pipe(tmp_path):
    """A child forked without exec (a worker) inherits the wakeup fd; stopping it with SIGTERM must
    not reach the parent's watcher, which would end a healthy parent with 143."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "previous = signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write('watcher'))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
        "    time.sleep(30)\n"
        "    os._exit(1)\n"
        "time.sleep(0.5)\n"
        "os.kill(pid, signal.SIGTERM)\n"
        "os.waitpid(pid, 0)\n"
        "time.sleep(2.5)\n"  # past the watcher's waits
        "signals.restore(previous)\n"
        "print('still here')\n"
    )
    record = tmp_path / "record"
    proc, _ = run_script(code, record, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here", proc.stderr
    assert not record.exists()


def test_a_signal_inside_held_is_taken_when_the_outermost_block_ends():
    """``held`` around an import: the handler does not raise inside it (an extension's
    initialization would turn the interruption into an ImportError, or crash); ``Interrupted``
    comes when the outermost block ends, once, for the first signal."""
    import os
    import signal

    from fastcifar.core import signals

    previous = signals.install()
    reached = []
    try:
        with pytest.raises(signals.Interrupted) as stopped:
            with signals.held():
                with signals.held():
                    os.kill(os.getpid(), signal.SIGTERM)
                    os.kill(os.getpid(), signal.SIGINT)
                    sum(range(1000))  # bytecodes, at which a handler that raised would have
                    reached.append("inner")
                reached.append("outer")
        assert stopped.value.exit_code == 143
    finally:
        signals.restore(previous)
    assert reached == ["inner", "outer"]
