"""The judging half of scripts/check_installs.sh: pip's dry-run reports of README's install lines
read, each resolved torch's arch list and DALI build checked against the compute capabilities its
line claims, one row appended to bench/results/installs.jsonl.

    python scripts/check_installs.py WORK OUT PIP_VERSION RECEIVED_MB "GENERATION|CAPABILITIES|EXTRAS" ...

WORK holds EXTRAS.json (``pip install --dry-run --report``) per line and pip-config.txt. The arch
list is not in a wheel's metadata: it comes from ``ARCHS``, one entry per (torch release, CUDA of its
pip wheel), each with where the fact came from; an entry is read from this Python's own torch when
that is the resolved release.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastcifar.core import gpu  # the preflight's rules: runs_on, DALI_MIN_CAPABILITY

# (torch release, CUDA of its pip wheel) -> (its arch list, where that fact came from)
ARCHS = {
    ("2.14", "13.0"): (
        "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
        "torch.cuda.get_arch_list() of the installed 2.14.1+cu130 wheel (this project's venv, 2026-12-03)",
    ),
    ("2.10", "12.8"): (
        "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
        "issue 69: torch._C._cuda_getArchFlags() of the installed 2.10.0 wheel (CUDA 12.8)",
    ),
}
# CUDA 13.0 dropped Maxwell, Pascal and Volta from its compiler (its release notes): a CUDA 13 wheel
# holds no code below sm_75 whatever else is known of it
CUDA_13_LOWEST = (7, 5)


def arch_list(torch_version: str, cuda: str) -> tuple[list[str] | None, str]:
    """The arch list of pip's torch ``torch_version`` built for ``cuda`` and where it came from (None: unknown)."""
    release = ".".join(torch_version.split("+")[0].split(".")[:2])
    try:
        import torch

        if torch.__version__.split("+")[0] == torch_version and torch.version.cuda == cuda:
            return torch.cuda.get_arch_list(), f"torch.cuda.get_arch_list() of {sys.executable}'s torch, read now"
    except ImportError:
        pass
    if (release, cuda) in ARCHS:
        archs, source = ARCHS[(release, cuda)]
        return archs.split(), source
    return None, f"unknown: no entry for torch {release} with CUDA {cuda}"


def judge(report: dict, generation: str, capabilities: list[str], command: str) -> dict:
    """One install line's row: what its dry run resolved, and whether torch and DALI run on each claimed capability."""
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    torch_version = resolved.get("torch", "")
    runtime = next((v for k, v in resolved.items() if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", k)), "")
    cuda = ".".join(runtime.split(".")[:2])
    archs, source = arch_list(torch_version, cuda)
    dali = [(k, int(m.group(1))) for k in resolved if (m := re.fullmatch(r"nvidia-dali-cuda(\d+)0", k))]
    checks = {}
    for cap in capabilities:
        c = tuple(int(x) for x in cap.split("."))
        torch_ok = None if archs is None else any(gpu.runs_on(a, c) for a in archs)
        if cuda and int(cuda.split(".")[0]) >= 13 and c < CUDA_13_LOWEST:
            torch_ok = False
        dali_ok = len(dali) == 1 and c >= gpu.DALI_MIN_CAPABILITY.get(dali[0][1], (0, 0))
        checks[cap] = {"torch": torch_ok, "dali": dali_ok}
    return {
        "generation": generation,
        "command": command,
        "torch": torch_version,
        "torch_cuda": cuda,
        **{k: resolved.get(k) for k in ("torchvision", "triton", "numpy")},
        "dali": [f"{k} {resolved[k]}" for k, _ in dali],
        "arch_list": archs,
        "arch_list_source": source,
        "runs_on": checks,
        "ok": all(v["torch"] and v["dali"] for v in checks.values()),
    }


def main(argv: list[str]) -> int:
    work, out, pip_version, received_mb, *lines = argv
    rows = []
    for line in lines:
        generation, caps, extras = line.split("|")
        report = json.loads((Path(work) / f"{extras}.json").read_text())
        rows.append(judge(report, generation, caps.split(), f"pip install -e '.[{extras}]'"))
        r = rows[-1]
        print(
            f"{'ok ' if r['ok'] else 'BAD'} {generation}: torch {r['torch']} (CUDA {r['torch_cuda'] or '?'}), "
            f"archs {r['arch_list']}, dali {r['dali']}: {r['runs_on']}",
            file=sys.stderr,
        )
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    config = Path(work) / "pip-config.txt"
    row = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pip": pip_version.split(" from ")[0],
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "commit": commit,
        "how": "pip install --dry-run --report --use-feature=fast-deps in a fresh venv; no wheel installed",
        "received_mb": int(received_mb),  # all of this machine's traffic while pip resolved (/proc/net/dev)
        # the machine's pip settings shape what resolves (an index, a constraint file capping torch)
        "pip_config": [ln for ln in config.read_text().splitlines() if not ln.startswith("#")]
        if config.exists()
        else [],
        "lines": rows,
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"appended to {out}", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
