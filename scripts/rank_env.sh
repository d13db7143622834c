#!/usr/bin/env bash
# One of several NCCL ranks on one GPU, for testing only (the multi-rank NCCL path on a
# machine with one GPU; a real run gives each rank its own GPU). The trainer's --share-gpu (a harness flag
# that --help leaves out) puts local rank r on GPU r mod (the GPU count). Runs COMMAND with:
#   NCCL_HOSTID=fastcifar-rankR  NCCL refuses two ranks on one device with the same host and bus id
#                              ("Duplicate GPU detected"); a host id of its own per rank makes each
#                              rank a host of its own to NCCL, joined over its network transport
#   NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=lo   that transport is sockets, over loopback
#   NCCL_DEBUG=INFO            NCCL's log says which transport it chose ("via NET/Socket/0")
# The other NCCL settings already in the environment are kept. As torchrun's entry (it sets RANK):
#   torchrun --standalone --nproc_per_node 2 --no-python bash scripts/rank_env.sh python -m fastcifar.train --share-gpu ...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bash scripts/rank_env.sh COMMAND [ARGS...] (under torchrun, which sets RANK)" >&2; exit 2; }
[ -n "${RANK:-}" ] || { echo "rank_env.sh: RANK is not set: start it under torchrun (or set RANK per rank)" >&2; exit 2; }
export NCCL_HOSTID="fastcifar-rank$RANK"
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
exec "$@"
