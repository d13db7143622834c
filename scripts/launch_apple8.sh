#!/usr/bin/env bash
# The seed's 8-GPU recipe: ResNet-9 at 256 images per GPU, 2048 global, one process per GPU.
#
#   scripts/launch_apple8.sh --data data                     # 8 GPUs on this machine
#   NPROC=4 scripts/launch_apple8.sh --data data             # 4 GPUs: same 2048 global, 512 each
#   NNODES=2 RDZV_ENDPOINT=host0:29500 scripts/launch_apple8.sh --data data   # run on every node
#   DRY_RUN=1 scripts/launch_apple8.sh --data data           # print the command, run nothing
#
# The flags are the `apple8` preset spelled out (the seed recipe with --batch-size 2048), so this
# works on branches that do not have the preset yet. The learning rate follows the rule in
# config.py and docs/presets.md: 0.4 per 512 of global batch -> a peak of 1.6 at 2048, whatever the
# number of GPUs. Flags given here come after ours, so they override (argparse keeps the last).
# Gradients are averaged by fastcifar.parallel.comm's buckets (--comm bucketed, 2 MiB); --comm ddp for the
# stock path. A rank that fails makes torchrun stop the others; one that stalls fails the rest
# after --dist-timeout-s.
set -euo pipefail

nproc="${NPROC:-8}"
python="${PYTHON:-python}"
launcher=("$python" -m torch.distributed.run --nproc_per_node "$nproc")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    launcher+=(--nnodes "${NNODES:-1}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
               --rdzv-id "${RDZV_ID:-fastcifar-apple8}")
else
    launcher+=(--standalone)
fi
cmd=("${launcher[@]}" -m fastcifar.train --preset resnet9 --batch-size 2048 --comm bucketed "$@")

if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
