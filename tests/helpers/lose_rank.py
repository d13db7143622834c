"""Test-only: the trainer with rank 1 lost before its first epoch (test_comm.py, before_first_epoch).

    python tests/helpers/lose_rank.py HOW TRAINER-ARGS...

HOW is where rank 1 is lost: ``stalled-at-handshake`` stops it (SIGSTOP) as its first run builds
the model, before the model handshake, where its peers wait up to the handshake's 60 s unless the
progress watchdog, started with the run, ends them at --dist-timeout-s; ``killed-in-warm-up`` kills
it (SIGKILL) as its first warm-up step starts, before any epoch. Every other rank runs the trainer
unchanged (RANK comes from the environment, as torchrun sets it).
"""

from __future__ import annotations

import os
import signal
import sys

import fastcifar.train as train


def lose(how: str) -> None:
    if how == "stalled-at-handshake":
        real = train.build_model

        def build_model(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it when its peer has ended
            return real(*args, **kwargs)

        train.build_model = build_model
    elif how == "killed-in-warm-up":
        real_make_step = train.make_step

        def make_step(*args, **kwargs):
            step = real_make_step(*args, **kwargs)

            def first_step_kills(images, labels):
                os.kill(os.getpid(), signal.SIGKILL)
                return step(images, labels)

            return first_step_kills

        train.make_step = make_step
    else:
        raise SystemExit(f"unknown HOW {how!r}")


if __name__ == "__main__":
    how, argv = sys.argv[1], sys.argv[2:]
    if os.environ.get("RANK") == "1":
        lose(how)
    sys.exit(train.main(argv))
