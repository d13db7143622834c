"""Kill one rank of a multi-rank training with SIGKILL and time how the other ranks end (issue 46).

    python scripts/kill_rank.py --ranks 2 --kill 1 --after-s 3 --dist-timeout-s 10 --out DIR -- \
        bash scripts/rank_env.sh python -m fastcifar.train --data data --epochs 200 --share-gpu ...

Starts COMMAND once per rank with the environment torchrun gives a rank (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), but not under torchrun: its agent stops the other ranks
itself (SIGTERM) as soon as one dies, so they would end by the signal, never by the path under
test. ``--dist-timeout-s T --out-dir DIR/runs`` are appended to COMMAND (a trainer's command line).
Once rank 0 has logged its first epoch (its epoch table's header: the ranks are in the training
loop), it waits AFTER_S, kills rank KILL, and waits for the others. The promise
(docs/distributed.md): each survivor prints one ``fastcifar: error: [rank N] lost contact with the
other ranks`` line and exits 3 within T + 11 s of losing its peer (the progress watchdog's timeout,
its 1 s poll and its 10 s record). Measured from the kill, plus ``--slack-s`` (5 s: the host may
queue steps past the kill before it blocks, and the process must exit). Each rank's stdout and
stderr go to DIR/rankR.out and DIR/rankR.err; the verdict to DIR/kill.json and one line on stdout.
Exit 0 when every survivor kept the promise, 1 when not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# The promise's bound past --dist-timeout-s (docs/distributed.md, "How a rank ends"): the watchdog
# polls once a second and gives the record 10 s (distributed.RECORD_TIMEOUT_S).
BOUND_PAST_TIMEOUT_S = 11.0
# Rank 0 prints this header with its first epoch's line: the ranks are past warm-up and capture.
TRAINING = "train_loss"
ERROR = "fastcifar: error:"
LOST = "lost contact with the other ranks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], ranks: int, out: Path, timeout_s: float) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        with open(out / f"rank{rank}.out", "w") as stdout, open(out / f"rank{rank}.err", "w") as stderr:
            procs.append(
                subprocess.Popen(
                    [*command, "--dist-timeout-s", f"{timeout_s:g}", "--out-dir", str(out / "runs")],
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                )
            )
    return procs


def wait_for_training(procs, out: Path, limit_s: float) -> str:
    """ "" once rank 0 has logged an epoch; else why not (a rank ended first, or the limit passed)."""
    deadline = time.monotonic() + limit_s
    while TRAINING not in (out / "rank0.out").read_text(errors="replace"):
        ended = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
        if ended:
            return "before training, " + ", ".join(f"rank {r} exited {code}" for r, code in ended)
        if time.monotonic() > deadline:
            return f"rank 0 logged no epoch within {limit_s:g} s"
        time.sleep(0.1)
    return ""


def watch_survivors(procs, killed: int, t_kill: float, limit_s: float) -> dict[int, tuple[int | None, float]]:
    """{rank: (exit status or None if still running at the limit, seconds from the kill)}."""
    ended: dict[int, tuple[int | None, float]] = {}
    survivors = [r for r in range(len(procs)) if r != killed]
    while len(ended) < len(survivors) and time.monotonic() - t_kill < limit_s:
        for r in survivors:
            if r not in ended and procs[r].poll() is not None:
                ended[r] = (procs[r].returncode, time.monotonic() - t_kill)
        time.sleep(0.05)
    for r in survivors:
        ended.setdefault(r, (None, time.monotonic() - t_kill))
    return ended


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(ERROR)]


def verdict(ended: dict, out: Path, bound_s: float, slack_s: float) -> tuple[bool, list[dict]]:
    survivors, ok = [], True
    for rank, (code, seconds) in sorted(ended.items()):
        lines = error_lines((out / f"rank{rank}.err").read_text(errors="replace"))
        problems = []
        if code is None:
            problems.append(f"still running {seconds:.1f} s after the kill")
        elif code != 3:
            problems.append(f"exit {code}, not 3")
        if code is not None and seconds > bound_s + slack_s:
            problems.append(f"ended {seconds:.1f} s after the kill, past the bound {bound_s:g} s + {slack_s:g} s")
        if len(lines) != 1 or LOST not in lines[0]:
            problems.append(f"{len(lines)} '{ERROR}' lines, not one naming lost contact")
        ok = ok and not problems
        survivors.append(
            {
                "rank": rank,
                "exit": code,
                "seconds": round(seconds, 2),
                "line": lines[0] if lines else "",
                "problems": problems,
            }
        )
    return ok, survivors


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("kill_rank: give the rank's command after --", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--kill", type=int, default=1, help="the rank to kill (not 0: rank 0 writes the run's record)")
    p.add_argument("--after-s", type=float, default=3.0, help="seconds of training before the kill")
    p.add_argument("--dist-timeout-s", type=float, default=10.0, help="the trainer's --dist-timeout-s")
    p.add_argument("--slack-s", type=float, default=5.0, help="allowed past the promised bound")
    p.add_argument("--ready-s", type=float, default=300.0, help="how long rank 0 may take to log its first epoch")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command or not 2 <= args.ranks <= 64 or not 1 <= args.kill < args.ranks or args.dist_timeout_s <= 0:
        print(
            "kill_rank: needs a command, 2..64 ranks, a rank to kill in 1..ranks-1 and a positive --dist-timeout-s",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    bound = args.dist_timeout_s + BOUND_PAST_TIMEOUT_S
    result = {
        "check": "kill-rank",
        "ranks": args.ranks,
        "killed": args.kill,
        "dist_timeout_s": args.dist_timeout_s,
        "bound_s": bound,
        "slack_s": args.slack_s,
        "command": command,
    }
    # a step limit's SIGTERM (gpu_visit.sh's timeout) must not orphan the ranks on the GPU: the
    # finally below kills them
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    procs = start(command, args.ranks, args.out, args.dist_timeout_s)
    try:
        why = wait_for_training(procs, args.out, args.ready_s)
        if why:
            result.update(ok=False, message=f"no kill: {why}", survivors=[])
        else:
            time.sleep(args.after_s)
            t_kill = time.monotonic()
            procs[args.kill].send_signal(signal.SIGKILL)
            ended = watch_survivors(procs, args.kill, t_kill, bound + args.slack_s + 30)
            ok, survivors = verdict(ended, args.out, bound, args.slack_s)
            slowest = max(s["seconds"] for s in survivors)
            result.update(
                ok=ok,
                survivors=survivors,
                seconds=slowest,
                message=(
                    f"rank {args.kill} killed; every other rank ended with exit 3 and one line within "
                    f"{slowest:.1f} s (bound {bound:g} s)"
                    if ok
                    else "; ".join(f"rank {s['rank']}: {', '.join(s['problems'])}" for s in survivors if s["problems"])
                ),
            )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    (args.out / "kill.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"kill_rank: {'ok' if result['ok'] else 'FAIL'}: {result['message']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
