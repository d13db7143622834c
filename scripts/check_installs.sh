#!/usr/bin/env bash
# Each GPU generation's install line of README's Install table, resolved against the registry without
# installing anything (pip install --dry-run --report, in a throwaway venv under /tmp), and the resolved
# torch's arch list checked against the compute capabilities the line claims; the DALI build too.
# One row goes to bench/results/installs.jsonl (date, pip version, what each line resolved to).
# Needs the registry, so it is not a CI test (issue 69, item 1).
#
#   bash scripts/check_installs.sh              # PYTHON: a Python with the project's requirements (its
#                                               # fastcifar.core.gpu rules judge the arch lists); default .venv's
#
# pip reads each wheel's metadata by HTTP range requests (--use-feature=fast-deps): a plain dry run
# downloads every wheel whole to read its metadata, 5 GB for the Volta line (torch 2.10.0: 916 MB, cuDNN
# 707 MB, ...) where the registry serves no separate metadata files.
# The arch list is not in a wheel's metadata: it comes from ARCHS below, one entry per (torch release,
# CUDA of its wheel), each with where the fact came from; an entry is read from this Python's own torch
# when that is the resolved release.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/results/installs.jsonl}
work=$(mktemp -d /tmp/fastcifar-installs.XXXXXX)
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q -U pip  # fast-deps and --report need a recent pip; this venv's only

# generation | capabilities it claims | the README line's extras
LINES=(
  "Volta (V100)|7.0|volta"
  "Turing and newer|7.5 8.0 8.6 8.9 9.0 10.0 12.0|dali"
)
received() {  # bytes this machine received (all interfaces), 0 where /proc/net/dev is not there
  python3 -c "print(sum(int(l.split(':')[1].split()[0]) for l in open('/proc/net/dev').readlines()[2:]))" 2>/dev/null || echo 0
}
before=$(received)
for line in "${LINES[@]}"; do
  IFS='|' read -r gen caps extras <<<"$line"
  echo "resolving: pip install -e '.[$extras]' ($gen)" >&2
  "$work/venv/bin/pip" install -q --dry-run --ignore-installed --use-feature=fast-deps \
    --report "$work/$extras.json" -e ".[$extras]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done
after=$(received)

# the machine's pip settings shape what resolves (an index, a constraint file capping torch): the row keeps them
"$work/venv/bin/pip" config list >"$work/pip-config.txt" 2>/dev/null || true
for f in $(sed -n "s/^.*constraint='\(.*\)'$/\1/p" "$work/pip-config.txt"); do
  [ -r "$f" ] && sed "s|^|$f: |" "$f" >>"$work/pip-config.txt"
done
"$PYTHON" - "$work" "$OUT" "$("$work/venv/bin/pip" --version)" "$(( (after - before) / 1000000 ))" "${LINES[@]}" <<'EOF'
import datetime, json, platform, re, subprocess, sys

sys.path.insert(0, ".")
from fastcifar.core import gpu  # noqa: E402  the preflight's rules: runs_on, DALI_MIN_CAPABILITY

work, out, pip_version, received_mb, *lines = sys.argv[1:]
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
# holds no sm_70 code whatever its arch list says
NO_VOLTA_FROM_CUDA = 13


def arch_list(torch_version: str, cuda: str) -> tuple[list[str] | None, str]:
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


rows = []
for line in lines:
    gen, caps, extras = line.split("|")
    report = json.load(open(f"{work}/{extras}.json"))
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    torch_version = resolved.get("torch", "")
    runtime = next((v for k, v in resolved.items() if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", k)), "")
    cuda = ".".join(runtime.split(".")[:2])
    archs, source = arch_list(torch_version, cuda)
    dali = [(k, int(m.group(1))) for k in resolved if (m := re.fullmatch(r"nvidia-dali-cuda(\d+)0", k))]
    checks = {}
    for cap in caps.split():
        c = tuple(int(x) for x in cap.split("."))
        torch_ok = None if archs is None else any(gpu.runs_on(a, c) for a in archs)
        if c < (7, 5) and cuda and int(cuda.split(".")[0]) >= NO_VOLTA_FROM_CUDA:
            torch_ok = False
        dali_ok = len(dali) == 1 and c >= gpu.DALI_MIN_CAPABILITY.get(dali[0][1], (0, 0))
        checks[cap] = {"torch": torch_ok, "dali": dali_ok}
    ok = all(v["torch"] and v["dali"] for v in checks.values())
    rows.append(
        {
            "generation": gen,
            "command": f"pip install -e '.[{extras}]'",
            "torch": torch_version,
            "torch_cuda": cuda,
            **{k: resolved.get(k) for k in ("torchvision", "triton", "numpy")},
            "dali": [f"{k} {resolved[k]}" for k, _ in dali],
            "arch_list": archs,
            "arch_list_source": source,
            "runs_on": checks,
            "ok": ok,
        }
    )
    print(f"{'ok ' if ok else 'BAD'} {gen}: torch {torch_version} (CUDA {cuda or '?'}), archs {archs}, "
          f"dali {rows[-1]['dali']}: {checks}", file=sys.stderr)

commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
row = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "pip": pip_version.split(" from ")[0],
    "python": platform.python_version(),
    "platform": f"{platform.system()} {platform.machine()}",
    "commit": commit,
    "how": "pip install --dry-run --report --use-feature=fast-deps in a fresh venv; no wheel installed",
    "received_mb": int(received_mb),  # all of this machine's traffic while pip resolved (/proc/net/dev)
    "pip_config": [ln for ln in open(f"{work}/pip-config.txt").read().splitlines() if not ln.startswith("#")],
    "lines": rows,
}
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
print(f"appended to {out}", file=sys.stderr)
sys.exit(0 if all(r["ok"] for r in rows) else 1)
EOF
