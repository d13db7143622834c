#!/usr/bin/env bash
# Nsight Systems profile of a few training steps after warm-up, with NVTX ranges per phase.
#
#   scripts/profile_nsys.sh [START:STOP] [-- trainer flags]
#   scripts/profile_nsys.sh 20:30 -- --data data                       # the default preset
#   NPROC=8 scripts/profile_nsys.sh 20:30 -- --data data --preset apple8  # under torchrun, 8 GPUs
#
# The trainer runs with --nvtx (ranges "data", "forward", "backward", "optimizer" around each
# step's phases; with --comm ddp the all-reduce kernels run inside "backward" on NCCL's stream)
# and --profile-steps START:STOP, which calls cudaProfilerStart after START timed steps of run 1
# and cudaProfilerStop after STOP: nsys records only that window (--capture-range=cudaProfilerApi),
# so cuDNN's algorithm search, the first allocations and the data load stay out of the report.
# With CUDA graphs (the default on CUDA) a step is one graph replay, marked as the range "step";
# its phases were marked once, at capture: add --cuda-graphs off to see them per step.
# Writes $OUT.nsys-rep (OUT defaults to runs/nsys-<date>) and prints the kernel and NVTX summaries.
# Needs nsys on PATH and a CUDA GPU; for CPU-only or where nsys cannot run, use
# scripts/profile_torch.py.
set -euo pipefail

window="20:30"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    window="$1"
    shift
fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
if [[ ! "$window" =~ ^[0-9]+:[0-9]+$ ]]; then
    echo "profile_nsys.sh: error: the window is START:STOP in timed steps, e.g. 20:30, not '$window'" >&2
    exit 2
fi
if ! command -v nsys >/dev/null 2>&1; then
    echo "profile_nsys.sh: error: nsys (Nsight Systems) is not on PATH; scripts/profile_torch.py needs only torch" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT="${OUT:-runs/nsys-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$(dirname "$OUT")"
if [[ -n "${NPROC:-}" ]]; then
    launch=(torchrun --nproc_per_node "$NPROC" -m fastcifar.train)
else
    launch=("$PYTHON" -m fastcifar.train)
fi

nsys profile \
    --trace=cuda,nvtx,cudnn,cublas,osrt \
    --capture-range=cudaProfilerApi --capture-range-end=stop \
    --cuda-memory-usage=false --force-overwrite=true \
    --output="$OUT" \
    "${launch[@]}" --runs 1 --nvtx --profile-steps "$window" "$@"

nsys stats --force-export=true --report cuda_gpu_kern_sum,nvtx_sum "$OUT.nsys-rep"
echo "report: $OUT.nsys-rep"
