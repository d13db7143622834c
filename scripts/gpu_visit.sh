#!/usr/bin/env bash
# One GPU visit, in stages that each fit one command on the GPU machine: at most 10 minutes, and at
# most 8 result files back from $OUT, two folders deep. Each stage leaves exactly three files in
# $OUT: STAGE-table.md (what passed, how long, the key figures), STAGE-logs.tar.gz (every log; no
# weights or data, which would pass the 16 MiB a file) and STAGE-results.tar.gz (bench/results/ as
# the stage left it). An accuracy stage is named accuracy-PRESET, so two in one call keep both.
# The table prints even when a step fails or the stage is cut short; the stage exits 1 if any step
# failed.
#
#   bash scripts/gpu_visit.sh check                    # (a) versions, CUDA tests, kernels at the presets' shapes
#   bash scripts/gpu_visit.sh engines                  # (b) 4 short epochs per engine combination + 1-rank NCCL
#   bash scripts/gpu_visit.sh bench                    # (c) step (the default preset, one of its 8 ranks, resnet9), augmentation and loader benchmarks
#   bash scripts/gpu_visit.sh kernels                  # (c') the fused bn/act/pool kernel vs eager and torch.compile
#   bash scripts/gpu_visit.sh accuracy PRESET [SEED]   # (d) runs of PRESET from SEED until the stage budget
#   bash scripts/gpu_visit.sh race                     # (e) official data: the default preset x25 beside the public scripts x25
#   bash scripts/gpu_visit.sh emulated PRESET N [RUNS] # (f) official data: PRESET at N emulated ranks x RUNS (10), rows in multi_gpu.jsonl
#   bash scripts/gpu_visit.sh nccl2                    # (g) two NCCL ranks on the one GPU: match one process, survive a kill -9
#   bash scripts/gpu_visit.sh conv                     # (h) official data: the fused conv (--fused-conv) beside cuDNN: kernel, step, runs
#   bash scripts/gpu_visit.sh screen                   # (i) official data: the default preset beside variants of it (SCREEN), x10 each
#   bash scripts/gpu_visit.sh levers                   # (j) official data: the candidate stack beside the default and the record, each lever's step
#   bash scripts/gpu_visit.sh deterministic            # (k) the default preset twice with --deterministic: same weights? its cost
#   bash scripts/gpu_visit.sh sweep                    # (l) many runs on one GPU: fastcifar sweep at 1, 2, 4 workers beside --runs N
#   bash scripts/gpu_visit.sh dali                     # optional: the DALI loader (needs its staged wheels)
#
# Race (scripts/race.py): fastcifar's default preset (RACE_PRESETS names others), then each public
# script whose copy is in RACE_SCRIPTS (default .stage/race, ignored: cifar10_speedrun.py of
# hiverge/cifar10-speedrun, airbench94_muon.py and legacy/airbench94.py of KellerJordan/cifar10-airbench,
# at the commits race.py names; RACE_PEERS picks them and their order), RACE_RUNS (25) runs each; the table and one row per trainer in
# bench/results/official.jsonl (RACE_CALL and RACE_COMMIT name the call and the commit in them).
# RACE_FLAGS (e.g. "--epochs 7"): added to every preset's runs, to confirm a screened variant x25
# beside the peers; refused before any run as the screen refuses a bad variant (also one that
# leaves a preset's recipe unchanged).
# Emulated: the N-GPU recipe's accuracy on this one GPU: PRESET with --emulate-ranks N
# (each rank's shard and draws, batchnorm statistics per rank over batch/N, gradients averaged as
# the all-reduce averages them), RUNS seeds from 0 in one process; the table and one row per set
# in bench/results/multi_gpu.jsonl (EMULATED_CALL and EMULATED_COMMIT name the call and the commit).
# nccl2: two NCCL ranks on this one GPU through scripts/rank_env.sh (both on cuda:0 by
# the harness's --share-gpu; an NCCL_HOSTID per rank, since NCCL refuses two
# ranks on one device of one host, so it joins them over sockets); graphs on, bucketed. The 2-rank
# run against one process training the same (--emulate-ranks 2) and the plain run over the same
# global batch; then rank 1 killed (SIGKILL) mid-training, rank 0 must end with one line and exit 3
# within --dist-timeout-s + 11 s (scripts/kill_rank.py). Both ranks fed rank 0's data with
# deterministic kernels (the harness's --rank0-data and --deterministic) must equal one process bit
# for bit; a --muon-shard run; the exit after the graphed 2-rank run, timed. The steps run sharpest
# first, so a stage cut short by its budget loses the tolerance comparisons. The table, NCCL's
# transport or its refusal, one row per check in bench/results/multi_gpu.jsonl (NCCL2_CALL and
# NCCL2_COMMIT name the call and commit).
# conv: the default preset's convs with the batchnorm statistics in their epilogue
# (kernels/conv_stats.py) against cuDNN + the normalize block, side by side in one call: the kernel
# table (bench/bench_conv_stats.py, rows in conv_stats.jsonl), its launch settings' forwards
# (bench/sweep_conv_stats.py, conv_sweep.jsonl), the graphed step both ways (step.jsonl),
# then CONV_RUNS (10) runs each way on official data, reported as the race reports its contenders
# (one row each in official.jsonl; CONV_CALL and CONV_COMMIT name the call and the commit). Its
# data is staged in the same call (cifar10_official.py --from-stage, ~30 s): give it
# STAGE_BUDGET_S=500, as the race.
# screen: the default's margin above 94% spent on time. The default preset, then
# each variant in SCREEN (flags added to it, ';' between variants; unset: SCREEN_DEFAULT below),
# SCREEN_RUNS (10) runs each from seed 0, one process each, on official data; every variant's flags
# are parsed and validated before any run (in a dry run too). Reported as the race reports its
# contenders, each variant named by its flags with its time ratio and accuracy difference to the
# default (one row each in official.jsonl; SCREEN_CALL and SCREEN_COMMIT name the call and the
# commit). The default runs once, first: a time ratio within about 3% needs confirming (the same
# default timed 2.4% apart in two calls: official.jsonl, calls "visit 9" and "visit 9b"). Confirm a
# winner with SCREEN="ITS FLAGS" SCREEN_RUNS=25 before it becomes the default.
# levers: the candidate preset (LEVERS_PRESET, default fast-levers: the default with the no-risk
# levers) against the default and the record, in one call of at most 9 minutes, in this order: the
# candidate x LEVERS_RUNS (25), the default x LEVERS_RUNS, hiverge's record script x LEVERS_RUNS on
# the same arrays (staged and run as the race runs it); then bench/bench_step.py at the default's
# batch, graphed: the default, each lever alone (every field where the candidate differs from the
# default: scripts/race.py levers, read from the presets table) and all of them, with what each
# removed per phase (rows in step.jsonl), and bench/bench_augment.py (the augmentation is no part of
# bench_step's step); then, each only where it fits, the candidate at batch 1536 and at 8.0 epochs,
# LEVERS_EXTRA_RUNS (10) each. One table over every run, rows in official.jsonl (LEVERS_CALL and
# LEVERS_COMMIT name the call and the commit). A missing candidate, or a lever the trainer refuses,
# ends the stage in one failed row before any GPU work.
# deterministic: the default preset as it runs, then twice with --deterministic (DETERMINISTIC_RUNS,
# 3, runs each from seed 0, one process each): the two must agree bit for bit, per-epoch figures
# and every model file; their train time beside the normal one's is the mode's cost. The table and
# one row in bench/results/deterministic.jsonl (DETERMINISTIC_CALL and DETERMINISTIC_COMMIT name
# the call and the commit). Official data when staged, else the synthetic set.
# sweep: many short runs on the one GPU (docs/sweeps.md): bench/bench_sweep.py, the default preset
# and a shorter one (SWEEP_EPOCHS, 2), each SWEEP_RUNS (12) runs as --runs N in one process, then as
# fastcifar sweep at --per-device 1, 2 and 4 (several runs at once where one leaves the GPU underused);
# models per hour and the per-run overhead (first run apart), rows in bench/results/sweep.jsonl
# (SWEEP_CALL names the call). Official data when staged, else the synthetic set. First, the check
# that a later run on an earlier run's kept engine, replaying its graphs, trains what a fresh
# capture trains (tests/unit/test_engine.py's GPU test, --deterministic).
# Data: $DATA, else .stage/data/cifar10-jpeg.tar.gz (bash ../shared/device/stage.sh data); the check,
# engines, bench and nccl2 stages fall back to a synthetic CIFAR-format set when neither exists.
# DALI: the dali stage needs it importable (PYTHONPATH=/tmp/site after stage.sh dali); the others
# give full value without it and add DALI rows only when it imports.
# Every stage runs from a copy of the checkout that imports as installed (scripts/stage_tree.py:
# kernels/ also as fastcifar/kernels), its PYTHONPATH: the GPU machine's Python has no install of
# this project. Results and staged data stay the checkout's (the copy links bench/results and .stage).
# DRY_RUN=1: runs nothing heavy on any machine: each step logs the command it would run (DRY_FAIL=NAME
# makes step NAME fail); the budget, table and bundles are real. tests/harness/test_gpu_visit.py runs it.
set -uo pipefail
stage=${1:-}
case "$stage" in
  check|engines|bench|kernels|accuracy|race|emulated|nccl2|conv|screen|levers|deterministic|sweep|dali) ;;
  *) echo "usage: bash scripts/gpu_visit.sh check|engines|bench|kernels|accuracy PRESET [SEED]|race|emulated PRESET N [RUNS]|nccl2|conv|screen|levers|deterministic|sweep|dali" >&2; exit 2 ;;
esac
tag=$stage
[ "$stage" = accuracy ] && tag="accuracy-${2:-}"
[ "$stage" = emulated ] && tag="emulated-${2:-}-x${3:-}"
py=${PYTHON:-python3}
# a path to the caller's Python (PYTHON=.venv/bin/python) stays valid in the copy the stage runs from
case "$py" in */*) [ -e "$py" ] && py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-gpu-visit}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
tree=$(mktemp -d)/checkout  # the importable copy the stage runs from (below)
budget=${STAGE_BUDGET_S:-530}  # stop starting steps after this: 600 s per command, less bundling
dry=${DRY_RUN:-0}
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rows=()
failed=0

note() { echo "$*" | tee -a "$work/notes.log"; }

step() {  # step NAME TIMEOUT_S COMMAND...: log to $work/NAME.log, one table row
  local name=$1 limit=$2; shift 2
  local left=$((budget - SECONDS)) t0=$SECONDS rc
  if [ "$left" -lt 15 ]; then
    rows+=("| $name | skipped: stage budget spent | 0 |"); failed=1; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  if [ "$dry" = 1 ]; then
    echo "dry run: $*" >"$work/$name.log"
    [ "${DRY_FAIL:-}" = "$name" ] && rc=1 || rc=0
  else
    timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
    rc=$?
  fi
  tail -n 15 "$work/$name.log"
  local status=ok
  [ $rc -eq 124 ] && status="TIMEOUT after ${limit}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAIL (exit $rc)"
  [ $rc -ne 0 ] && failed=1
  rows+=("| $name | $status | $((SECONDS - t0)) |")
  return $rc
}

finish() {  # always: the table, the bundles, the exit status
  {
    echo "## gpu_visit $tag: $(date -u +%Y-%m-%dT%H:%M:%SZ), ${SECONDS}s of ${budget}s"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    [ -f "$work/figures.md" ] && { echo; cat "$work/figures.md"; }
  } >"$out/$tag-table.md"
  tar -czf "$out/$tag-logs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.npz' --exclude='*.tmp' \
    --exclude=./synthetic -C "$work" . 2>/dev/null
  tar -czf "$out/$tag-results.tar.gz" -C "$root/bench" results 2>/dev/null
  rm -rf "$work" "$(dirname "$tree")"
  echo
  cat "$out/$tag-table.md"
  exit $failed
}
trap finish EXIT

# paths given relative to the checkout stay so from the copy
absolute() { case $1 in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
data=$(absolute "${DATA:-.stage/data/cifar10-jpeg.tar.gz}")
[ -n "${RACE_SCRIPTS:-}" ] && RACE_SCRIPTS=$(absolute "$RACE_SCRIPTS")
# also in a dry run: its commands then run (or would run) exactly as on the GPU machine
if ! "$py" scripts/stage_tree.py "$tree" >"$work/stage-tree.log" 2>&1; then
  cat "$work/stage-tree.log"; rows+=("| stage-tree | FAIL: $(tail -n 1 "$work/stage-tree.log") | 0 |"); failed=1; exit
fi
cd "$tree"
note "running from $tree, the copy scripts/stage_tree.py laid out"
ensure_data() {  # real data when staged, else a synthetic official-format set (learnable, 10k images)
  if [ -e "$data" ]; then return 0; fi
  data="$work/synthetic"
  step synthetic-data 120 "$py" -c "
import sys; sys.path.insert(0, 'tests')
from pathlib import Path
from conftest import write_official
write_official(Path('$data'), per_batch=2000, n_test=2000)"
}

dali_ok() { [ "$dry" = 1 ] || "$py" -c "import nvidia.dali" >/dev/null 2>&1; }

default_preset() {  # "NAME BATCH": the trainer's default preset and its global batch (also in a dry run)
  "$py" -c "from fastcifar.core.config import from_preset; from fastcifar.core.presets import DEFAULT_PRESET; print(DEFAULT_PRESET, from_preset().batch_size)" \
    2>"$work/default-preset.log"
}

train() {  # train NAME TIMEOUT FLAGS...: one trainer invocation logging into $work/runs/NAME
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$py" -m fastcifar.train --data "$data" --out-dir "$work/runs/$name" "$@"
}

contender() {  # contender NAME LIMIT FLAGS...: RUNS runs of $preset from seed 0 with FLAGS, unless the budget is spent
  local name=$1 limit=$2; shift 2
  [ "$limit" -ge 30 ] || { rows+=("| $name | skipped: stage budget spent | 0 |"); failed=1; return 1; }
  train "$name" "$limit" --preset "$preset" --seed 0 --runs "$runs" --quiet "$@"
}

check_variants() {  # check_variants STEP PRESET VARIANTS...: scripts/race.py variants, or the stage ends in one failed row
  "$py" scripts/race.py variants "$2" -- "${@:3}" >"$work/$1.log" 2>&1 && return
  cat "$work/$1.log"; rows+=("| $1 | FAIL: $(tail -n 1 "$work/$1.log") | 0 |"); failed=1; exit
}

race_table() {  # race_table STEP LIMIT CALL COMMIT: scripts/race.py's table over this stage's runs, rows in official.jsonl
  step "$1" "$2" "$py" scripts/race.py report "$work" --fastcifar "$work/runs" --data "$data" \
    --jsonl bench/results/official.jsonl --call "$3" --commit "$4" --out "$work/figures.md"
}

case "$stage" in
check)
  step versions 60 bash -c "nvidia-smi; $py -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version()); print(\"triton\", triton.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())'"
  step cuda-tests 240 "$py" -m pytest -q -m cuda tests -p no:cacheprovider
  # the cuda-marked kernel cases (full preset sizes) ran in cuda-tests just above: not twice in one budget;
  # the two loader tests are not cuda-marked but run Triton on CUDA tensors where there is a GPU
  step kernel-tests 240 "$py" -m pytest -q -m "not cuda" tests/kernels/test_kernel_bn_act_pool.py tests/kernels/test_kernel_augment.py \
    tests/kernels/test_kernel_cutout.py tests/unit/test_loader.py::test_triton_loader_batch_under_cuda_layouts \
    tests/unit/test_loader.py::test_loader_with_triton_kernels_equals_the_reference -p no:cacheprovider
  # the fused conv's small cases (its preset-size ones are cuda-marked: in cuda-tests), a step of its
  # own so that a timeout in either leaves the other's result
  step conv-kernel-tests 120 "$py" -m pytest -q -m "not cuda" tests/kernels/test_kernel_conv_stats.py -p no:cacheprovider
  ;;
engines)
  ensure_data
  # 4 epochs: the default preset (FastNet) freezes its whitening bias after 3, and the step then replays its second graph
  for kernels in auto triton torch; do
    for graphs in on off; do
      train "k-$kernels-g-$graphs" 150 --subset 10000 --epochs 4 --kernels "$kernels" --cuda-graphs "$graphs" --loader torch
    done
  done
  # torchrun through $py: a bare torchrun on PATH may belong to another Python than the other steps.
  # --dist-group always: without it one rank forms no group, and no bucket, comm stream or NCCL
  # collective would run (gpu_visit_report.py fails the step if its run had no group).
  step nccl-1rank 150 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 -m fastcifar.train --data "$data" \
    --out-dir "$work/runs/nccl-1rank" --subset 10000 --epochs 4 --comm bucketed --dist-group always \
    --cuda-graphs on --loader torch
  if dali_ok; then
    train "dali-g-on" 150 --subset 10000 --epochs 4 --kernels triton --cuda-graphs on --loader dali
  fi
  step engine-checks 60 "$py" scripts/gpu_visit_report.py engines "$work/runs" --out "$work/figures.md"
  ;;
bench)
  ensure_data
  if default=$(default_preset); then  # the default preset's network at its batch, first
    step bench-step-default 100 "$py" bench/bench_step.py --preset "${default% *}" --batches "${default#* }"
    # the step one of 8 ranks takes (the default's batch / 8 images, buckets on), as rank 0
    # of a fake 8-rank group: compute and the buckets' launches, no communication. Eager, then
    # graphed: the eager trace names the ops behind "other" (a third of the step: visits/visit-12.md, 12d)
    step bench-step-8rank 100 "$py" bench/bench_step.py --preset "${default% *}" --fake-world 8 --graphs off on --kernels auto
  else
    rows+=("| bench-step-default | FAIL: the default preset could not be read (default-preset.log) | 0 |"); failed=1
  fi
  step bench-step 150 "$py" bench/bench_step.py
  step bench-augment 120 "$py" bench/bench_augment.py
  loaders=torch; dali_ok && loaders="dali torch"
  [ -f "$data" ] && step bench-loader 100 "$py" bench/bench_loader.py --device cuda --data "$data" --loaders $loaders
  ;;
kernels)
  # alone: eager and graph-replay timings x 3 impls x 3 directions and a compile per block, for the
  # default preset's 6 blocks (bench/kernel_registers.py's PRESET_BLOCKS 18-23; fast's and resnet9's 0-11, measured
  # in bench/results/visits/visit-5.md, 5b, would not fit beside them: about 270 s for those twelve)
  default_blocks="18 19 20 21 22 23"
  step bench-bn 420 "$py" bench/bench_bn_act_pool.py --blocks $default_blocks
  # the launch table against the settings it was chosen from (bench/results/bn_sweep.md)
  step sweep-bn 150 "$py" bench/sweep_bn_act_pool.py --blocks $default_blocks \
    --settings base before-2026-11-22 pt2048 w2 t4096p256
  ;;
accuracy)
  preset=${2:?usage: gpu_visit.sh accuracy PRESET [SEED]}
  seed=${3:-0}
  first=$seed
  [ -e "$data" ] || { note "accuracy needs real data: \$DATA or .stage/data/cifar10-jpeg.tar.gz"; failed=1; exit; }
  last=0
  # one process per seed, so a cut-off stage loses at most the run in progress; the next starts
  # only if the last one's duration (x1.2) still fits the budget
  while [ $((budget - SECONDS)) -gt $((last * 12 / 10 + 15)) ]; do
    t0=$SECONDS
    train "$preset-seed$seed" $((budget - SECONDS)) --preset "$preset" --seed "$seed" --runs 1 || true
    last=$((SECONDS - t0)); seed=$((seed + 1))
    [ "$dry" = 1 ] && [ $((seed - first)) -ge 3 ] && break  # a dry run's steps take no time
  done
  note "next chunk: bash scripts/gpu_visit.sh accuracy $preset $seed"
  step accuracy-table 60 "$py" scripts/gpu_visit_report.py accuracy "$work/runs" --out "$work/figures.md"
  ;;
race)
  # official CIFAR-10 ($DATA: the folder `stage.sh cifar10` rebuilds there) for every trainer
  [ -e "$data" ] || { note "the race needs real data: \$DATA (official CIFAR-10, bash ../shared/device/stage.sh cifar10)"; failed=1; exit; }
  presets=${RACE_PRESETS:-}
  if [ -z "$presets" ] && default=$(default_preset); then presets=${default% *}; fi
  [ -n "$presets" ] || { note "no preset to race: the default preset could not be read (default-preset.log)"; failed=1; exit; }
  runs=${RACE_RUNS:-25}
  race="$work/race"
  # RACE_FLAGS: a screened variant confirmed beside the peers instead of the preset itself (its rows
  # are named by its recipe); added to every preset in RACE_PRESETS, each checked as the screen
  # checks its variants, before any run, in the words that run (read splits at the first newline)
  read -ra race_flags <<<"${RACE_FLAGS:-}"
  if [ -n "${RACE_FLAGS:-}" ]; then
    for preset in $presets; do check_variants race-flags "$preset" "${race_flags[*]}"; done
  fi
  # fastcifar first: a race cut short still has its contender (a cut-off trainer writes the runs it
  # finished to summary.json, a public script's log holds the rows it printed)
  for preset in $presets; do
    contender "$preset-runs" 240 "${race_flags[@]}"
  done
  # the public scripts read cifar10/{train,test}.pt under their working folder (else they download,
  # which fails offline); scripts/race.py copies each with only the run count (and hiverge's sleep
  # between runs) changed, checked against the commit its row names
  if step export-tensors 120 "$py" scripts/export_tensors.py --data "$data" --out "$race/cifar10" &&
     step prepare-peers 30 "$py" scripts/race.py prepare "${RACE_SCRIPTS:-.stage/race}" "$race" --images "$race/cifar10" --runs "$runs"; then
    # in RACE_PEERS's order (the record first by default); each may use what is left but 40 s for
    # the table: their max-autotune compile alone took over 200 s (visits/visit-8.md, 8b), so one
    # call holds fastcifar and about one script; a cut-off script's finished runs still count
    for name in ${RACE_PEERS:-hiverge airbench94_muon airbench94}; do
      case "$name" in
        hiverge) file=cifar10_speedrun.py ;;
        airbench94_muon) file=airbench94_muon.py ;;
        airbench94) file=airbench94.py ;;
        *) rows+=("| $name | FAIL: not a public script the race knows (hiverge, airbench94_muon, airbench94) | 0 |"); failed=1; continue ;;
      esac
      [ "$dry" = 1 ] || [ -f "$race/$name/$file" ] || continue  # not staged: prepare-peers said so
      limit=$((budget - SECONDS - 40))
      [ "$limit" -ge 30 ] || { rows+=("| $name | skipped: stage budget spent | 0 |"); continue; }
      step "$name" "$limit" bash -c "cd '$race/$name' && exec '$py' '$file'"
    done
  fi
  race_table race-table 60 "${RACE_CALL:-}" "${RACE_COMMIT:-}"
  ;;
emulated)
  preset=${2:?usage: gpu_visit.sh emulated PRESET N [RUNS]}
  ranks=${3:?usage: gpu_visit.sh emulated PRESET N [RUNS]}
  runs=${4:-10}
  [ -e "$data" ] || { note "emulated needs real data: \$DATA (official CIFAR-10, bash ../shared/device/stage.sh cifar10)"; failed=1; exit; }
  # one process, as the race runs the default: a cut-off run loses only the run in progress (its
  # summary.json holds the ones it finished); 40 s kept for the table and the rows
  train "$preset-x$ranks" $((budget - SECONDS - 40)) --preset "$preset" --emulate-ranks "$ranks" --seed 0 \
    --runs "$runs" --quiet
  step emulated-table 60 "$py" scripts/gpu_visit_report.py emulated "$work/runs" --data "$data" \
    --jsonl bench/results/multi_gpu.jsonl --call "${EMULATED_CALL:-}" --commit "${EMULATED_COMMIT:-}" --out "$work/figures.md"
  ;;
nccl2)
  ensure_data
  short=(--subset 10000 --epochs 2 --cuda-graphs on --comm bucketed --loader torch)
  # torchrun runs the wrapper (--no-python: its entry is a program, here bash), which sets the rank's
  # environment and execs the trainer; a failed run's log keeps NCCL's refusal for the report
  step nccl2-ranks 180 "$py" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
    bash scripts/rank_env.sh "$py" -m fastcifar.train --data "$data" --out-dir "$work/runs/nccl2-ranks" "${short[@]}" \
    --share-gpu
  # when the launcher ended: the report times the exit after a graphed NCCL run from summary.json's
  # write (pytorch#115388: ncclCommDestroy can hang after capture; the trainer bounds it at 5 s)
  date +%s.%N >"$work/nccl2-ranks.ended"
  # The sharp check (the harness's flags): both ranks fed rank 0's data, deterministic kernels
  # (torch's, not Triton's), so each rank's gradient is the same and (g + g) / 2 = g in fp16: the
  # 2 ranks must equal one process given the same data bit for bit (its whitening reads rank 0's
  # 2500 images, as the 2 ranks' summed covariance does), or backward and the bucket all-reduces
  # are misordered on their streams.
  same=(env CUBLAS_WORKSPACE_CONFIG=:4096:8)
  step nccl2-same 150 "${same[@]}" "$py" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
    bash scripts/rank_env.sh "$py" -m fastcifar.train --data "$data" --out-dir "$work/runs/nccl2-same" \
    "${short[@]}" --kernels torch --rank0-data 2 --deterministic --share-gpu
  step nccl2-same-1rank 120 "${same[@]}" "$py" -m fastcifar.train --data "$data" --out-dir "$work/runs/nccl2-same-1rank" \
    "${short[@]}" --kernels torch --rank0-data 2 --deterministic --whiten-images 2500
  # the ranks started without torchrun, whose agent would stop rank 0 itself (SIGTERM) once rank 1
  # died; kill_rank.py appends --dist-timeout-s 10 and --out-dir, and 200 epochs outlast the kill
  step nccl2-kill 150 "$py" scripts/kill_rank.py --ranks 2 --kill 1 --after-s 3 --dist-timeout-s 10 --ready-s 90 --out "$work/kill" -- \
    bash scripts/rank_env.sh "$py" -m fastcifar.train --data "$data" --subset 10000 --epochs 200 --cuda-graphs on \
    --comm bucketed --loader torch --share-gpu
  # Muon's sharded orthogonalization and its all-reduce (a 1-rank group never reduces the shards)
  step nccl2-shard 150 "$py" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
    bash scripts/rank_env.sh "$py" -m fastcifar.train --data "$data" --out-dir "$work/runs/nccl2-shard" \
    "${short[@]}" --muon-shard --share-gpu
  # what the 2 ranks train, in one process (their shards, draws and batchnorm statistics), and plain
  train nccl2-emulated 120 --emulate-ranks 2 "${short[@]}"
  train nccl2-1rank 120 "${short[@]}"
  step nccl2-checks 60 "$py" scripts/gpu_visit_report.py nccl2 "$work/runs" --log "$work/nccl2-ranks.log" \
    --kill "$work/kill/kill.json" --ended "$work/nccl2-ranks.ended" --jsonl bench/results/multi_gpu.jsonl \
    --call "${NCCL2_CALL:-}" --commit "${NCCL2_COMMIT:-}" --out "$work/figures.md"
  ;;
conv)
  [ -e "$data" ] || { note "conv needs real data: \$DATA (official CIFAR-10, bash ../shared/device/stage.sh cifar10)"; failed=1; exit; }
  default=$(default_preset) || { note "the default preset could not be read (default-preset.log)"; failed=1; exit; }
  preset=${default% *}
  runs=${CONV_RUNS:-10}
  # the kernel table first: a fused kernel that fails on this GPU shows there before the runs
  step bench-conv 90 "$py" bench/bench_conv_stats.py
  # its launch settings, forward only, beside cuDNN's (the base setting's forward took 2.4-6.2x
  # cuDNN's: visits/visit-11.md, 11c)
  step sweep-conv 180 "$py" bench/sweep_conv_stats.py
  for variant in cudnn fused; do
    flag=(); [ "$variant" = fused ] && flag=(--fused-conv)
    step "step-$variant" 60 "$py" bench/bench_step.py --preset "$preset" --batches "${default#* }" --graphs on \
      --kernels auto "${flag[@]}"
  done
  # the runs: each may use what is left but 40 s for the table (the rows in official.jsonl are the
  # call's point), the first at most half of that, so the second gets as much
  for variant in cudnn fused; do
    flag=(); [ "$variant" = fused ] && flag=(--fused-conv)
    limit=$((budget - SECONDS - 40)); [ "$variant" = cudnn ] && limit=$((limit / 2))
    contender "$preset-$variant" "$limit" "${flag[@]}"
  done
  race_table conv-table 40 "${CONV_CALL:-}" "${CONV_COMMIT:-}"
  ;;
screen)
  [ -e "$data" ] || { note "screen needs real data: \$DATA (official CIFAR-10, bash ../shared/device/stage.sh cifar10)"; failed=1; exit; }
  default=$(default_preset) || { note "the default preset could not be read (default-preset.log)"; failed=1; exit; }
  preset=${default% *}
  runs=${SCREEN_RUNS:-10}
  # Screened already (official.jsonl, calls "visit 12" to "visit 12c"; visits/visit-12.md): the
  # record's jitter buys half an epoch back (fast-jitter, the default), but not a whole one (93.95% at
  # 8), and label smoothing 0.09, batch 1536 and the record's rates did not help at 8 epochs. What is
  # left of the margin, spent on the evaluation and a quarter epoch: TTA on the least confident test
  # images only (--tta-share 0.25 cost 0.001 point on the same weights: visits/visit-11.md, "Seeds,
  # processes"), and 8.25 epochs with and without it.
  SCREEN_DEFAULT="--tta-share 0.25;--tta-share 0.5;--epochs 8.25;--epochs 8.25 --tta-share 0.5"
  IFS=';' read -ra variants <<<"${SCREEN-$SCREEN_DEFAULT}"
  # a typo must not cost the visit: each variant parses and validates on the preset first, and must
  # change the recipe, each its own way (a contender's runs are pooled by its recipe's name)
  check_variants screen-flags "$preset" "${variants[@]}"
  i=0
  for flags in "" "${variants[@]}"; do
    read -ra extra <<<"$flags"
    name=$preset; [ -n "$flags" ] && name="v$i$(printf '%s' "$flags" | tr -c 'A-Za-z0-9.' '-' | tr -s '-')"
    i=$((i + 1))
    # 10 runs take about 35 s with their process's start (about 2.1 s a run after the first, H100);
    # a stuck variant may not take the others' time
    limit=$((budget - SECONDS - 40)); [ "$limit" -gt $((runs * 8 + 90)) ] && limit=$((runs * 8 + 90))
    contender "$name" "$limit" "${extra[@]}"
  done
  race_table screen-table 40 "${SCREEN_CALL:-}" "${SCREEN_COMMIT:-}"
  ;;
levers)
  [ -e "$data" ] || { note "levers needs real data: \$DATA (official CIFAR-10, bash ../shared/device/stage.sh cifar10)"; failed=1; exit; }
  default=$(default_preset) || { note "the default preset could not be read (default-preset.log)"; failed=1; exit; }
  base=${default% *}
  candidate=${LEVERS_PRESET:-fast-levers}
  # each lever alone, one line of flags each; the candidate missing (or equal to the default) ends
  # the stage here, in one row, before anything runs on the GPU
  # (their flags alone on stdout: a warning on stderr must not become a lever)
  if ! "$py" scripts/race.py levers "$candidate" --base "$base" >"$work/levers.txt" 2>"$work/levers.log"; then
    cat "$work/levers.log"; rows+=("| levers | FAIL: $(tail -n 1 "$work/levers.log") | 0 |"); failed=1; exit
  fi
  mapfile -t levers <"$work/levers.txt"
  note "levers of $candidate over $base: $(printf '[%s] ' "${levers[@]}")"
  check_variants lever-flags "$base" "${levers[@]}"
  # the extras: a variant the candidate already is (its own batch or epochs) is left out, not failed
  extras=()
  for flags in "--batch-size 1536" "--epochs 8.0"; do
    if "$py" scripts/race.py variants "$candidate" -- "$flags" >"$work/extra-flags.log" 2>&1; then
      extras+=("$flags")
    else
      rows+=("| $candidate $flags | skipped: $(tail -n 1 "$work/extra-flags.log") | 0 |")
    fi
  done
  runs=${LEVERS_RUNS:-25}
  # 1. the three trainers, same arrays; each fastcifar set at most about 4 s a run beyond its
  # process's start (2.1 s a run on an H100: visits/visit-12.md), so a stuck one leaves the record
  # its time; 160 s kept for the record's shortest useful limit (30), the step bench and the table
  for preset in "$candidate" "$base"; do
    limit=$((budget - SECONDS - 160)); [ "$limit" -gt $((runs * 4 + 60)) ] && limit=$((runs * 4 + 60))
    contender "$preset-x$runs" "$limit"
  done
  race="$work/race"
  if step export-tensors 120 "$py" scripts/export_tensors.py --data "$data" --out "$race/cifar10" &&
     step prepare-peers 30 "$py" scripts/race.py prepare "${RACE_SCRIPTS:-.stage/race}" "$race" --images "$race/cifar10" --runs "$runs"; then
    # the record's 25 runs rank above the benches below, which get what it leaves: it keeps all but
    # the table's 45 s. Visit 9's hiverge took 225 s to warm up and about 5 s a run after it: past
    # 2 x 25 fastcifar runs it may still be cut short (its finished runs count)
    limit=$((budget - SECONDS - 45))
    if [ "$dry" != 1 ] && [ ! -f "$race/hiverge/cifar10_speedrun.py" ]; then
      rows+=("| hiverge | FAIL: not staged (prepare-peers.log) | 0 |"); failed=1
    elif [ "$limit" -lt 30 ]; then
      rows+=("| hiverge | skipped: stage budget spent | 0 |"); failed=1
    else
      step hiverge "$limit" bash -c "cd '$race/hiverge' && exec '$py' cifar10_speedrun.py"
    fi
  fi
  # 2. with the time left, each only if it fits beside the table's 40 s (left out, not failed, else):
  # each lever's step and the stack's, beside the default's, at the default's batch, graphed
  left() { [ $((budget - SECONDS - 40)) -ge "$1" ] || { rows+=("| $2 | left out: no time left | 0 |"); return 1; }; }
  upto() { local l=$((budget - SECONDS - 40)); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }  # a limit that keeps the table's time
  variant_args=()
  for flags in "${levers[@]}"; do variant_args+=("--variant=$flags"); done
  [ "${#levers[@]}" -gt 1 ] && variant_args+=("--variant=${levers[*]}")
  if left 45 bench-levers; then
    step bench-levers "$(upto 90)" "$py" bench/bench_step.py --preset "$base" --batches "${default#* }" --graphs on \
      --kernels auto "${variant_args[@]}"
  fi
  # the augmentation kernel (no part of bench_step's step), without torch.compile's baseline (timed in
  # visits/visit-12.md, 12e; its compiles would take most of the step's 20 s)
  left 20 bench-augment && step bench-augment "$(upto 45)" "$py" bench/bench_augment.py --no-compile
  # 3. the candidate at the record's batch and at 8 epochs
  preset=$candidate
  runs=${LEVERS_EXTRA_RUNS:-10}
  for flags in "${extras[@]}"; do
    read -ra extra <<<"$flags"
    name="$candidate$(printf '%s' "$flags" | tr -c 'A-Za-z0-9.' '-' | tr -s '-')"
    left 60 "$name" || continue
    limit=$((budget - SECONDS - 40)); [ "$limit" -gt $((runs * 8 + 90)) ] && limit=$((runs * 8 + 90))
    contender "$name" "$limit" "${extra[@]}"
  done
  race_table levers-table 40 "${LEVERS_CALL:-}" "${LEVERS_COMMIT:-}"
  ;;
deterministic)
  ensure_data
  default=$(default_preset) || { note "the default preset could not be read (default-preset.log)"; failed=1; exit; }
  preset=${default% *}
  runs=${DETERMINISTIC_RUNS:-3}
  # each invocation: its start-up (capture, warm-up, ~30 s) and 3 runs of a few seconds; a stuck one
  # may take no more than its share of what is left but 60 s for the checks
  left=3
  for name in normal a b; do
    flag=(); [ "$name" != normal ] && flag=(--deterministic)
    limit=$(((budget - SECONDS - 60) / left)); [ "$limit" -gt 150 ] && limit=150
    left=$((left - 1))
    contender "deterministic-$name" "$limit" "${flag[@]}"
  done
  step deterministic-checks 60 "$py" scripts/gpu_visit_report.py deterministic "$work/runs" --data "$data" \
    --jsonl bench/results/deterministic.jsonl --call "${DETERMINISTIC_CALL:-}" --commit "${DETERMINISTIC_COMMIT:-}" \
    --out "$work/figures.md"
  ;;
sweep)
  ensure_data
  default=$(default_preset) || { note "the default preset could not be read (default-preset.log)"; failed=1; exit; }
  preset=${default% *}
  runs=${SWEEP_RUNS:-12}
  # a later run on the engine (graphs) of an earlier one equals that run captured fresh (--deterministic)
  step sweep-reuse 120 "$py" -m pytest -q -p no:cacheprovider tests/unit/test_engine.py -k gpu
  # each configuration: 4 commands (--runs N, then 1, 2, 4 workers), each a process start-up (~30 s
  # with capture) and 12 runs of a few seconds; the shorter one takes what the default left
  step sweep-default $(((budget - SECONDS) * 3 / 5)) "$py" bench/bench_sweep.py --device cuda --full --data "$data" \
    --preset "$preset" --runs "$runs" --per-device 1,2,4 --record --label "${SWEEP_CALL:-}"
  step sweep-short $((budget - SECONDS)) "$py" bench/bench_sweep.py --device cuda --full --epochs "${SWEEP_EPOCHS:-2}" \
    --data "$data" --preset "$preset" --runs "$runs" --per-device 1,2,4 --record --label "${SWEEP_CALL:-}"
  ;;
dali)
  if ! dali_ok; then note "DALI does not import: stage it first (bash ../shared/device/stage.sh dali)"; failed=1; exit; fi
  ensure_data
  step dali-version 60 "$py" -c "import nvidia.dali as d; print('dali', d.__version__)"
  step dali-tests 200 "$py" -m pytest -q tests/unit/test_dali.py -p no:cacheprovider
  for graphs in on off; do
    train "dali-g-$graphs" 120 --subset 10000 --epochs 4 --kernels triton --cuda-graphs "$graphs" --loader dali
  done
  [ -f "$data" ] && step bench-loader 120 "$py" bench/bench_loader.py --device cuda --data "$data" --loaders dali torch
  step engine-checks 60 "$py" scripts/gpu_visit_report.py engines "$work/runs" --out "$work/figures.md"
  ;;
esac
