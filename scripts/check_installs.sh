#!/usr/bin/env bash
# Each GPU generation's install line of README's Install table, resolved against the registry without
# installing anything (pip install --dry-run --report, in a throwaway venv under /tmp), and the resolved
# torch's arch list checked against the compute capabilities the line claims; the DALI build too.
# One row (date, pip version, what each line resolved to) goes to runs/installs.jsonl, the user's own
# (ignored) folder, or with --record to the project's record, bench/results/installs.jsonl; OUT=FILE names
# another file. Needs the registry, so it is not a CI test.
#
#   bash scripts/check_installs.sh [--record]   # PYTHON: a Python with the project's requirements (its
#                                               # fastcifar.core.gpu rules judge the arch lists); default .venv's
#
# pip reads each wheel's metadata by HTTP range requests (--use-feature=fast-deps): a plain dry run
# downloads every wheel whole to read its metadata, 5 GB for the Volta line (torch 2.10.0: 916 MB, cuDNN
# 707 MB, ...) where the registry serves no separate metadata files.
# The arch list is not in a wheel's metadata: scripts/check_installs.py, which judges the reports, has
# a table of them with where each fact came from.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
record=runs/installs.jsonl
for arg in "$@"; do
  case $arg in
    --record) record=bench/results/installs.jsonl ;;
    *) echo "check_installs.sh: error: unknown argument '$arg' (usage: check_installs.sh [--record])" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$record}
mkdir -p "$(dirname "$OUT")"
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
"$PYTHON" scripts/check_installs.py "$work" "$OUT" "$("$work/venv/bin/pip" --version)" "$(( (after - before) / 1000000 ))" \
  "${LINES[@]}"
