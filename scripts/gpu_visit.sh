#!/usr/bin/env bash
# One visit to a GPU machine: correctness of the GPU paths first, then the figures the issues ask
# for, each step's log under $OUT (or ./gpu-visit) and a short table of what passed at the end.
#
#   bash scripts/gpu_visit.sh [quick|full]
#
# quick: CUDA tests + kernel, step and loader benches (about 10 minutes on an H100).
# full:  also the resnet9 reference accuracy on the JPEG copy (5 runs) and fast vs resnet9.
# Data: .stage/data/cifar10-jpeg.tar.gz if present (bash ../shared/device/stage.sh data), else $DATA.
# DALI: used when it imports (PYTHONPATH=/tmp/site after the stage.sh dali steps), else skipped.
set -uo pipefail
mode=${1:-quick}
out=${OUT:-gpu-visit}
mkdir -p "$out"
data=${DATA:-.stage/data/cifar10-jpeg.tar.gz}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
results=()

step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember pass/fail and seconds
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  results+=("$(printf '%-22s %-6s %5ss' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)))")
}

step versions python3 -c "import torch, triton, datetime; print(datetime.datetime.now().isoformat(), torch.__version__, triton.__version__, torch.cuda.get_device_name()); import nvidia.dali as d; print('dali', d.__version__)"
step cifar-copies bash -c "find / -xdev -iname '*cifar*' -not -path '*/proc/*' 2>/dev/null | grep -v \"$PWD\" | head -20; true"
step cuda-tests python3 -m pytest -q -m cuda tests
step kernel-tests python3 -m pytest -q tests/test_kernel_bn_act_pool.py tests/test_kernel_augment.py tests/test_kernel_cutout.py
step bench-bn python3 bench/bench_bn_act_pool.py
step bench-augment python3 bench/bench_augment.py
step bench-step python3 bench/bench_step.py
[ -f "$data" ] && step bench-loader python3 bench/bench_loader.py --device cuda --data "$data"
if [ "$mode" = full ] && [ -f "$data" ]; then
  step resnet9-reference python3 bench/bench_train.py --preset resnet9 --runs 5 --out-dir "$out/runs" -- --data "$data"
  step fast-vs-resnet9 python3 bench/bench_train.py --preset fast --runs 5 --compare resnet9 --out-dir "$out/runs" -- --data "$data"
fi
cp -r bench/results "$out/" 2>/dev/null
echo; echo "step                   result  time"; printf '%s\n' "${results[@]}"
