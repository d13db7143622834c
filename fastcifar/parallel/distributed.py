"""Ranks, devices and process groups: one process per device, launched by torchrun (or alone).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (srun's tasks get them from Slurm's variables:
``slurm_environment``); a process started without them is rank 0 of 1 and creates no process
group unless asked to (``--dist-group always``: a real group of one, so the multi-rank path runs
on one device). NCCL joins GPU ranks, gloo CPU ranks.

Nothing waits forever: every collective is bounded by ``--dist-timeout-s`` (gloo's timeout and
the progress watchdog's), the start-up handshakes by at most ``HANDSHAKE_TIMEOUT_S``, the waits for
the data (one rank per node fetches and decodes it: ``load_once_per_node``) by ``data_timeout``. A
rank that dies closes its gloo sockets and the others fail at once; one that stalls fails them after
the timeout. The survivors print one line, record the cause in log.txt and summary.json (status
"failed") and exit 3, whichever thread sees it first. Under NCCL the same holds because
``failure_settings`` sets NCCL's own failure handling before the group exists: its watchdog
aborts the communicators instead of the process, later than fastcifar's (see there).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from fastcifar.core import environment, gpu, signals
from fastcifar.core.config import ConfigError
from fastcifar.core.errors import DataError, first_line


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def pick_device(requested: str, local_rank: int, settings=None, own_gpus: bool = False) -> torch.device:
    """This rank's device, after ``core.gpu.before_cuda_work``: torch must have code for the GPU,
    ``settings`` (the run's Config, when given) a --loader and --compress the GPU can run, and
    Triton's cache a folder that exists. The one place a training device is picked, before any
    CUDA work. GPU ``local_rank`` of those visible (torchrun: every rank of a node sees all its
    GPUs); ``own_gpus`` (srun started this process): a rank that sees fewer GPUs than its local
    rank + 1 sees only its own (``srun --gpus-per-task 1`` leaves one in CUDA_VISIBLE_DEVICES) and
    takes the first."""
    if requested == "cpu":
        return torch.device("cpu")
    use_cuda, notice = gpu.cuda_or_cpu(requested)  # --device cuda without CUDA: refused here
    if not use_cuda:
        if notice and local_rank == 0:  # one line per machine, before the run says it trains on the CPU
            print(f"fastcifar: {notice}", file=sys.stderr, flush=True)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    share = getattr(settings, "share_gpu", False)  # the harness's --share-gpu: ranks take the GPUs in turn
    if own_gpus and count == 1 and local_rank >= count:  # srun --gpus-per-task 1: its own GPU, the only one
        index = 0
    elif not share and local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} has no GPU: this machine has {count}"
            + (" visible (CUDA_VISIBLE_DEVICES)" if "CUDA_VISIBLE_DEVICES" in os.environ else "")
        )
    else:
        index = local_rank % count
    note = gpu.before_cuda_work(
        index,
        loader=getattr(settings, "loader", "auto"),
        compress=getattr(settings, "compress", "none"),
    )
    if note and local_rank == 0:  # as the CPU notice above: one line per machine
        print(f"fastcifar: {note}", file=sys.stderr, flush=True)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def data_ranks(cfg, ctx: DistContext) -> tuple[int, int]:
    """(rank, world size) whose data this rank trains on: its own, or (0, N) under the harness's
    ``--rank0-data N`` (every rank's gradient then the same: the all-reduce checked bit for bit)."""
    return (0, cfg.rank0_data) if cfg.rank0_data else (ctx.rank, ctx.world_size)


def apply_determinism(cfg, device: torch.device) -> str:
    """``--deterministic``: torch's deterministic kernels where it has them (it warns, naming the op,
    where it has none; --compile's inductor follows into its deterministic mode: no autotuning),
    and on a GPU cuDNN's deterministic algorithms without the benchmark search and cuBLAS's fixed
    workspace (``environment.deterministic_cublas``, before the run's first matmul). Returns the
    run's one start-up line on what is and what is not covered ("" without the flag, which
    changes nothing: torch's settings are the process's, so a Python caller's earlier
    deterministic run leaves them on). The Triton kernels sum in a fixed order (no atomics: a
    test checks kernels/ for any), so they need no variant."""
    if not cfg.deterministic:
        return ""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type != "cuda":
        return (
            f"deterministic: torch's deterministic kernels; equal to the bit only with the same torch build, CPU "
            f"type and thread count ({torch.get_num_threads()} here: oneDNN and the reductions split their sums "
            f"by thread) and, with several ranks, the same rank count"
        )
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    cublas, set_here = environment.deterministic_cublas()
    return (
        f"deterministic: cuDNN's deterministic algorithms (no benchmark search), torch's deterministic kernels "
        f"(a warning names any op without one), {environment.CUBLAS_WORKSPACE}={cublas} "
        f"({'set for this run' if set_here else 'as given'}), the Triton kernels atomic-free; not covered: another "
        f"GPU model, rank count or torch/CUDA/cuDNN/NCCL version (each fixes its own summation order: NCCL's "
        f"all-reduce by rank count and topology), image folders decoded by DALI's nvJPEG without a decode cache"
    )


# The rendezvous port of an srun launch when MASTER_PORT is not exported: every task derives the
# same one from the job id, with no message between them; 20000-29999 stays below Linux's ephemeral
# range (32768-60999), where the OS hands out ports to outgoing connections.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``scontrol show hostnames`` where Slurm's tools are
    installed, else the list's own syntax for its first entry (``gpu[03-04,07],cpu1`` -> ``gpu03``;
    one bracket per name, the form Slurm prints for a cluster's usual names)."""
    import shutil
    import subprocess

    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass  # the list's own syntax below
    first, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        first += ch
    if "[" not in first:
        return first
    head, rest = first.split("[", 1)
    ranges, tail = rest.split("]", 1)
    if "[" in tail:
        raise ConfigError(f"cannot read the first host of the Slurm node list {nodelist!r}: export MASTER_ADDR")
    return head + ranges.split(",")[0].split("-")[0] + tail


# Ranks in one job: 2**20, ten times the largest GPU jobs run; c10d keeps ranks in 32-bit ints, so
# a WORLD_SIZE of 10**20 ended in torch's own traceback when the group was formed.
MAX_RANKS = 1 << 20


def _whole(environ, name: str, default: str, lowest: int, launcher: str) -> int:
    """The launcher variable ``name`` as a whole number in ``lowest``..MAX_RANKS, or ConfigError in
    one line naming it: read before any process group, which would fail on it with a traceback."""
    value = environ.get(name, default)
    text = value.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 30):
        raise ConfigError(f"bad {launcher} environment: {name} must be a whole number, not {value!r}")
    number = int(text)
    if not lowest <= number <= MAX_RANKS:
        raise ConfigError(f"bad {launcher} environment: {name} must lie in {lowest}..{MAX_RANKS:,}, not {value!r}")
    return number


def slurm_environment(environ) -> dict[str, str]:
    """torchrun's variables for a process that ``srun`` started as one task of a step, from Slurm's;
    empty when torchrun's are set (``torchrun`` inside an allocation sets its own) or when srun did
    not start this process (an sbatch script's own shell has SLURM_PROCID and SLURM_NTASKS, but no
    SLURM_STEP_NUM_TASKS: a Python started there stays one process). RANK = SLURM_PROCID,
    LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = the step's task count; MASTER_ADDR as exported, else
    127.0.0.1 on one node, else the step's first node (block distribution, Slurm's default and the
    only one accepted where a node runs several tasks, puts task 0 there); MASTER_PORT as exported, else
    ``SLURM_PORT_BASE`` + (the job id + the step id) mod ``SLURM_PORT_SPAN``."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return {}
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}
    tasks = _whole(environ, "SLURM_STEP_NUM_TASKS", "1", 1, "srun")
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        if not _whole(environ, name, "0", 0, "srun") < tasks:
            raise ConfigError(
                f"bad srun environment: {name} {environ[name]!r} is not below SLURM_STEP_NUM_TASKS {tasks}"
            )
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        if name in environ:
            _whole(environ, name, "1", 1, "srun")
    # one node's tasks must be numbered contiguously, as torchrun numbers them: the data is read once
    # per node by rank - local rank's task (load_once_per_node), and task 0's node is the first. With
    # no more tasks than nodes (one task, or one a node) every layout is that; srun then often sets
    # SLURM_DISTRIBUTION=cyclic itself, although no --distribution was given
    layout = environ.get("SLURM_DISTRIBUTION", "block").split(":")[0]
    nodes = environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1"))
    one_a_node = tasks <= int(nodes)
    if layout not in ("block", "") and not one_a_node:
        raise ConfigError(
            f"srun --distribution {environ['SLURM_DISTRIBUTION']}: fastcifar needs each node's tasks numbered "
            "one after another (block, srun's default)"
        )
    mapped = {
        "RANK": environ["SLURM_PROCID"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
    }
    if "MASTER_ADDR" not in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
        if nodes == "1":
            mapped["MASTER_ADDR"] = "127.0.0.1"
        elif nodelist:
            mapped["MASTER_ADDR"] = first_host(nodelist)
        else:
            raise ConfigError("srun on several nodes without a node list: export MASTER_ADDR (task 0's host)")
    if "MASTER_PORT" not in environ:
        if "SLURM_JOB_ID" not in environ:
            raise ConfigError("srun without SLURM_JOB_ID: export MASTER_PORT")
        job = environ["SLURM_JOB_ID"].split("_")[0]  # an array task's id reads JOB_TASK in some tools
        if not (job.isascii() and job.isdigit()):
            raise ConfigError(f"SLURM_JOB_ID {environ['SLURM_JOB_ID']!r} is not a number: export MASTER_PORT")
        step = environ.get("SLURM_STEP_ID", "0")  # two steps of one job at once: two rendezvous
        step = int(step) if step.isascii() and step.isdigit() else 0
        mapped["MASTER_PORT"] = str(SLURM_PORT_BASE + (int(job) + step) % SLURM_PORT_SPAN)
    return mapped


def setup(requested_device: str, timeout_s: float = 300.0, group: str = "auto", settings=None) -> DistContext:
    """Read torchrun's environment, pick this rank's device and join the process group: with several
    ranks, or also alone with ``group="always"`` (``--dist-group always``), so that one rank builds
    the gradient buckets, runs their comm stream and captures their collectives as several do.
    A process that ``srun`` started gets torchrun's variables from Slurm's first (``slurm_environment``).
    ``settings``: the run's Config, whose --loader and --compress the preflight checks against the GPU."""
    slurm = slurm_environment(os.environ)
    os.environ.update(slurm)  # where init_process_group's env:// rendezvous and the logs read them
    world_size = _whole(os.environ, "WORLD_SIZE", "1", 1, "torchrun")
    rank = _whole(os.environ, "RANK", "0", 0, "torchrun")
    local_rank = _whole(os.environ, "LOCAL_RANK", "0", 0, "torchrun")
    if not (rank < world_size and local_rank < world_size):
        raise ConfigError(
            f"bad torchrun environment: RANK {rank}, LOCAL_RANK {local_rank}, WORLD_SIZE {world_size} "
            f"(RANK and LOCAL_RANK must lie in 0..WORLD_SIZE-1)"
        )
    if world_size > 1 or "MASTER_ADDR" in os.environ:  # a group will be formed at MASTER_ADDR:MASTER_PORT
        _check_master_port()
    device = pick_device(requested_device, local_rank, settings, own_gpus=bool(slurm))
    _data_step.done = False  # a new run: its data step is ahead (announce_stop)
    if world_size == 1 and group != "always":
        return DistContext(0, 1, 0, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout_s = failure_settings(backend, timeout_s)  # NCCL: its failure handling, before the group exists
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if world_size == 1 and "MASTER_ADDR" not in os.environ:  # alone, not under torchrun: no one to meet
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        except ValueError as exc:  # torch's own check of the environment (a missing MASTER_ADDR, ...)
            raise ConfigError(f"bad torchrun environment: {first_line(str(exc)) or type(exc).__name__}") from None
    return DistContext(rank, world_size, local_rank, device, backend)


def _check_master_port() -> None:
    """MASTER_PORT as torch's rendezvous reads it, refused in one line instead of its traceback."""
    port = os.environ.get("MASTER_PORT")
    if port is None:  # torch's rendezvous says so itself (a ValueError: one line, in setup)
        return
    if not (port.strip().isascii() and port.strip().isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"bad torchrun environment: MASTER_PORT must be a port number 1..65535, not {port!r}")


# NCCL's timeout over --dist-timeout-s. The progress watchdog must see a stall first, so that the
# rank records the cause and exits 3: NCCL counts from when a collective was queued, which can be
# before the loop's last beat (the host runs ahead of the GPU), and the watchdog polls once a
# second, then records for up to RECORD_TIMEOUT_S (10 s). 60 s covers these several times over.
NCCL_TIMEOUT_MARGIN_S = 60.0


def failure_settings(backend: str, timeout_s: float) -> float:
    """Set NCCL's failure handling in the environment, where ProcessGroupNCCL reads it when it is
    created (so before ``init_process_group``), and return the group's timeout. gloo: nothing set,
    ``timeout_s`` unchanged (it raises in the main thread: exit 3 as it is).

    What torchrun leaves (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, torch/distributed/elastic/agent/server/
    local_elastic_agent.py; torch's own default is 3) makes NCCL's watchdog thread rethrow a timed-out
    collective's error and so kill the process (std::terminate: SIGABRT and a C++ dump, no
    summary.json), racing fastcifar's progress watchdog. Values as documented for torch 2.4-2.14
    (docs.pytorch.org torch_nccl_environment_variables; ProcessGroupNCCL.hpp ErrorHandlingMode,
    SHOULD_TEAR_DOWN / SHOULD_CLEAN_UP; ProcessGroupNCCL.cpp Watchdog::runLoop):

    - TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timeout or NCCL error the watchdog aborts
      the communicators and leaves the process alone; the main thread's next use of the group then
      raises DistBackendError ("NCCL communicator was aborted on rank N", NCCLUtils.cpp), which
      ``is_comm_failure`` recognizes: one line, the record, exit 3. Overrides torchrun's 1.
    - TORCH_NCCL_BLOCKING_WAIT=0: blocking wait makes every ``work.wait()`` block the host until the
      collective completes (pytorch#47943: "significant performance overhead"), which would
      serialize the bucketed all-reduce with backward. Overrides a 1 in the environment.
    - NCCL's timeout is ``timeout_s + NCCL_TIMEOUT_MARGIN_S``, so fastcifar's watchdog fires first
      in the training loop; NCCL's bounds the eager collectives outside it. Collectives replayed
      from a CUDA graph are outside NCCL's watchdog altogether (the progress watchdog covers them).
    - TORCH_NCCL_DUMP_ON_TIMEOUT=0 unless set: no flight-recorder dump files (recent releases
      default it to on, and their heartbeat monitor then ends the process, SIGABRT, a
      TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC after the dump), and TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1000
      unless set: after a timeout the watchdog waits 4x this for the dump before it aborts (a
      minute at the 15 s default). Both stay as given when a user sets them to debug a hang; so
      does TORCH_NCCL_TRACE_BUFFER_SIZE (the flight recorder's size, 0 unless set), which only
      feeds that dump.
    """
    if backend != "nccl":
        return timeout_s
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ:
        os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"
        os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "1000")
    return timeout_s + NCCL_TIMEOUT_MARGIN_S


# Fields that name places on this machine: nodes may keep the data, cache and logs at different paths.
LOCAL_FIELDS = ("data", "download", "cache_dir", "out_dir")
# All ranks have just joined the group when the handshake runs, so 60 s is generous; NCCL creates
# its communicator in that first collective, which takes seconds, not minutes, on 8 GPUs.
HANDSHAKE_TIMEOUT_S = 60.0


def config_digest(cfg) -> str:
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in LOCAL_FIELDS}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """Names, shapes and dtypes of the parameters and buffers, not their values."""
    items = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in [*model.named_parameters(), *model.named_buffers()]]
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


def check_same(digest: str, what: str, ctx: DistContext, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Fail on every rank, with the same message, unless all ranks hold the same ``digest``.

    Every rank gathers every digest, so every rank sees a mismatch and raises: none is left
    waiting in a later collective for a rank that already gave up."""
    if not ctx.distributed:
        return
    mine = torch.tensor(list(bytes.fromhex(digest)[:16]), dtype=torch.uint8).view(torch.int64).to(ctx.device)
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    digests = [bytes(g.cpu().view(torch.uint8).tolist()).hex() for g in gathered]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError(
            f"ranks disagree on the {what}: rank(s) {', '.join(map(str, differ))} differ from "
            f"rank 0 (digest {digests[0][:12]}); launch every rank with the same settings and code"
        )


def from_rank0(value: str, ctx: DistContext, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> str:
    """Rank 0's ``value`` (a short string) on every rank; ``value`` itself with one rank."""
    if not ctx.distributed:
        return value
    data = torch.zeros(4096, dtype=torch.uint8)
    if ctx.is_main:
        raw = value.encode("utf-8")[:4096]
        data[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    data = data.to(ctx.device)
    dist.broadcast(data, src=0, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    return bytes(data.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")


# How long a rank waits for the data step of the others (``load_once_per_node``):
# the official archive is 170 MB, so 600 s lets the one download per node run at 0.3 MB/s (a slow
# shared link); reading the pickled batches takes about a second, and PIL decodes 60,000 32x32 JPEG
# files in about 20 s on 2 CPU cores (6,000 in 1.9 s, measured on the CI machine). A longer
# --dist-timeout-s lengthens it too.
DATA_TIMEOUT_S = 600.0

T = TypeVar("T")
# Keys of the waits below in the rendezvous store: numbered in call order, which is the same on
# every rank, and by torchrun's restart count, so a second run of the Python API in one process, or
# a restarted worker group that meets the same store, never finds an earlier wait's keys.
_WAITS = itertools.count()


def data_timeout(dist_timeout_s: float) -> float:
    return max(DATA_TIMEOUT_S, dist_timeout_s)


def _store_key(name: str) -> str:
    return f"fastcifar/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_WAITS)}/{name}"


def _store():
    """The process group's rendezvous store (torch's own store-based barrier waits on it too). The
    data waits use it rather than a collective: nothing is pending in NCCL while a rank downloads,
    so neither the group's timeout nor NCCL's watchdog can end a healthy run, and a wait can be
    longer than --dist-timeout-s."""
    return dist.distributed_c10d._get_default_store()


class PeerDataError(DataError):
    """Another rank could not load the data: its failure, as this rank reports it."""


class PeerStopped(dist.DistError):
    """Another rank stopped with an error of its own (``announce_stop``) while this one waited on
    the store for the data: a comm failure as ``is_comm_failure`` sees it, so this rank ends with
    exit 3, and the stopped rank's own line (exit 2) is the first cause."""


def _stopped_key() -> str:
    """One key a run: set by a rank that stops with an error before its data step is done, read by
    every store wait. Scoped like the waits' keys (``_store_key``): by torchrun's restart count,
    which a restart for a change of membership does not advance (torch elastic), so such a restart
    after an early stop would find the key set; fastcifar's runs do not change membership."""
    return f"fastcifar/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/stopped"


class _DataStep(threading.local):
    done = False  # this rank has finished load_once_per_node: nobody waits for it on the store any more


_data_step = _DataStep()


def announce_stop(ctx: DistContext | None, detail: str) -> None:
    """Tell the ranks waiting on the rendezvous store that this one stopped, and why (first line of
    ``detail``); the trainer calls it when a rank ends with an error of its own (not a lost peer's,
    which the others learn of in their collectives; not an interrupt, which torchrun delivers to
    every rank). Only until this rank's data step is done: nobody waits for it on the store after
    that, and a store whose host has gone would print a C++ trace for every late call. Why: a rank that fails before the
    data (rank 0 alone checks --out-dir; a --resume checkpoint's errors reach every rank through
    their broadcast) never reaches the data waits, and on another node no launcher stops the ranks
    that wait for it: they would wait out the data timeout, 600 s, before saying anything.
    With it they end within a second (``_wait``). Best effort: a store that is gone already ends
    their waits by itself."""
    if ctx is None or not ctx.distributed or _data_step.done:  # after its data step no one waits on the store
        return
    first = first_line(detail) or "no message"
    try:
        _store().set(_stopped_key(), json.dumps([ctx.rank, first[:300]]))
    except Exception:
        pass


def _wait(store, keys: list[str], timeout_s: float, failed: str, ctx: DistContext) -> list[str]:
    """Wait until every key is set; the keys still missing when ``timeout_s`` ran out (none: all
    set). Raises PeerDataError as soon as a rank has set ``failed``: a second at a time, so a failure
    elsewhere ends this wait within a second, not at its timeout; so does a rank that stopped with an
    error of its own anywhere before (``announce_stop``: PeerStopped)."""
    deadline = time.monotonic() + timeout_s
    stopped = _stopped_key()
    while True:
        if store.check(keys):  # all there: a rank that stops after setting its key stopped after the wait
            return []
        if store.check([failed]):
            rank, local_rank, detail = json.loads(store.get(failed).decode())
            who = (
                f"local rank 0 of this node (rank {rank})"
                if rank == ctx.rank - ctx.local_rank
                else f"rank {rank}" + (" (local rank 0 of its node)" if local_rank == 0 else "")
            )
            raise PeerDataError(f"{who} could not load the data: {detail}")
        if store.check([stopped]):
            rank, detail = json.loads(store.get(stopped).decode())
            raise PeerStopped(f"rank {rank} stopped while the ranks were loading their data: {detail}")
        left = deadline - time.monotonic()
        if left < 0.01:  # a store counts its timeout in whole milliseconds, and 0 means no timeout at all
            return [k for k in keys if not store.check([k])]
        try:
            store.wait(keys, datetime.timedelta(seconds=min(1.0, left)))
            return []
        except RuntimeError:  # DistStoreError on a timeout; a store that is gone raises again in check
            if all(store.check([k]) for k in keys):
                return []


def load_once_per_node(load: Callable[[bool], T], ctx: DistContext, doing: str, timeout_s: float) -> T:
    """``load(True)`` on local rank 0 of each node; the node's other ranks wait for it, then call
    ``load(False)``: with --download one fetch per node, and one process per node that decodes an
    image folder and writes its cache, which the others then read. Then every rank waits until all
    have loaded, so the model handshake that follows waits seconds (it has HANDSHAKE_TIMEOUT_S),
    not however long the slowest node's download takes. ``doing``: what local rank 0 is busy with,
    for the message when ``timeout_s`` runs out. A rank that fails to load tells the others, which
    raise a DataError naming it instead of waiting out the timeout. The waits are on the rendezvous
    store (``_store``), not in a collective."""
    if not ctx.distributed:
        return load(True)
    _data_step.done = False
    store, base = _store(), _store_key("data")
    first = ctx.rank - ctx.local_rank  # torchrun numbers a node's ranks contiguously
    mine, failed = f"{base}/node-of-rank-{first}", f"{base}/failed"
    try:
        if ctx.local_rank == 0:
            result = load(True)
            store.set(mine, "ok")
        else:
            if _wait(store, [mine], timeout_s, failed, ctx):
                raise DataError(
                    f"local rank 0 of this node (rank {first}) is still {doing} after {timeout_s:g} s; "
                    f"a slower link or disk needs a larger --dist-timeout-s (the data waits "
                    f"{DATA_TIMEOUT_S:g} s or that, whichever is longer)"
                )
            result = load(False)
    except (PeerDataError, PeerStopped):  # another rank's failure: it told the others itself
        raise
    except BaseException as exc:  # this rank's own failure: the others stop waiting for it
        detail = first_line(str(exc)) or type(exc).__name__
        try:
            store.set(failed, json.dumps([ctx.rank, ctx.local_rank, detail]))
        except Exception:  # the store is gone too: the others' wait runs out and says so
            pass
        raise
    ready = [f"{base}/ready/{r}" for r in range(ctx.world_size)]
    store.set(ready[ctx.rank], "1")
    missing = _wait(store, ready, timeout_s, failed, ctx)
    if missing:
        ranks = ", ".join(k.rsplit("/", 1)[1] for k in missing)
        raise DataError(
            f"rank(s) {ranks} still without their data after {timeout_s:g} s (local rank 0 of "
            f"their node may still be downloading or decoding it); a slower link or disk needs "
            f"a larger --dist-timeout-s (the data waits {DATA_TIMEOUT_S:g} s or that, whichever "
            f"is longer)"
        )
    _data_step.done = True
    return result


def is_comm_failure(exc: BaseException) -> bool:
    """NCCL and the rendezvous store raise DistError subclasses; gloo reports a dead peer ("Connection
    reset by peer") or a timeout ("Timed out waiting 10000ms for recv") as a plain RuntimeError
    raised from its transport's source files."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in str(exc))


# A C++ source location in gloo's and c10d's messages, "[/pytorch/third_party/gloo/gloo/transport/tcp/
# pair.cc:534] " or "../torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:3119:": a build path, nothing for the user
_SOURCE = re.compile(r"\[?[\w./+-]*\.(?:cc|cpp|cxx|c|h|hpp|cu)(?::\d+)*\]?:?\s*")


def _without_sources(text: str) -> str:
    return " ".join(_SOURCE.sub(" ", text).split())


def failure_message(exc: BaseException, timeout_s: float) -> str:
    """One line for a collective that failed because another rank died or stalled (or, PeerStopped,
    for a wait on the store that another rank's own error ended: its words)."""
    if isinstance(exc, PeerStopped):
        return str(exc)
    detail = _without_sources(first_line(str(exc))) or type(exc).__name__
    return (
        f"lost contact with the other ranks (one exited, was killed, or stalled past "
        f"--dist-timeout-s {timeout_s:g}): {detail[:300]}"
    )


def report_failure(line: str, stream=None) -> bool:
    """Print this rank's one failure line; False (nothing printed) if another thread is already
    ending the rank. gloo's timeout (the main thread) and the watchdog (its own thread) share
    --dist-timeout-s, so both can see a stalled peer in the same second, and a SIGTERM's watcher
    (core/signals.py) may be ending it too: the user gets one line, not two (``claim_ending``)."""
    if not signals.claim_ending():
        return False
    print(line, file=stream or sys.stderr, flush=True)
    return True


# How long the watchdog lets ``on_stall`` record the cause before it ends the rank regardless: the
# record is a few small local writes, but the disk may itself be what hangs.
RECORD_TIMEOUT_S = signals.RECORD_TIMEOUT_S


class ProgressWatchdog:
    """Ends this rank (one line, exit 3) when the training loop makes no progress for ``timeout_s``.

    NCCL's own watchdog bounds eagerly issued collectives, but not those replayed from a CUDA
    graph (PyTorch leaves captured collectives out of it), and a host blocked in a graph launch or
    a device synchronize waits forever for a stalled peer. It is also the first to fire: NCCL's
    timeout is later by ``NCCL_TIMEOUT_MARGIN_S`` (``failure_settings``). The loop calls
    ``beat()`` after every step (a float store: nothing on the hot path); a daemon thread checks
    once a second.

    The main thread is blocked, so no ``finally`` of its runs: before ``os._exit`` the watchdog
    calls ``on_stall(reason)`` (the trainer passes ``report.stop_open_logs``), so log.txt and
    summary.json record the cause (status "failed"), bounded by ``RECORD_TIMEOUT_S``."""

    def __init__(
        self,
        timeout_s: float,
        ctx: DistContext,
        enabled: bool,
        stream=sys.stderr,
        on_stall: Callable[[str], None] | None = None,
        grace_s: float = 0.0,
    ):
        self.timeout_s, self.ctx, self.stream, self.on_stall = timeout_s, ctx, stream, on_stall
        # until settle(): the start-up bound, at least grace_s (see Watchdog in run/components.py)
        self.bound = max(timeout_s, grace_s)
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._watch, name="fastcifar-watchdog", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def settle(self) -> None:
        """Start-up is over: from now on ``timeout_s`` without a beat ends the rank."""
        self.bound = self.timeout_s
        self.beat()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            idle, bound = time.monotonic() - self.last, self.bound
            if idle > bound:
                past = f"--dist-timeout-s {self.timeout_s:g}" if bound == self.timeout_s else f"start-up's {bound:g} s"
                reason = (
                    f"lost contact with the other ranks (no training progress for {idle:.0f} s, past "
                    f"{past}: a peer stalled or died)"
                )
                if not report_failure(f"fastcifar: error: [rank {self.ctx.rank}] {reason}", self.stream):
                    return  # another thread saw it first and is ending the rank (its line, its record)
                if self.on_stall is not None:  # in a thread of its own, waited on for RECORD_TIMEOUT_S
                    signals.call_bounded(self.on_stall, reason, RECORD_TIMEOUT_S)
                signals.exit_now(3)  # the main thread is blocked in CUDA or NCCL: nothing else can end it

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def stop_reason(exc: BaseException) -> str:
    """Why the run stopped, for log.txt and summary.json. A SIGTERM under torchrun usually means
    another rank failed (torchrun then stops every rank) rather than a user's stop, and this rank
    cannot tell which: the reason says so, instead of a bare "interrupted by SIGTERM"."""
    reason = str(exc)
    if (
        isinstance(exc, signals.Interrupted)
        and exc.signum == signal.SIGTERM
        and os.environ.get("TORCHELASTIC_RUN_ID")
        and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1")  # no int(): this runs on the way out
    ):
        reason += (
            " (from torchrun, which stops every rank when one of them fails or when it is stopped "
            "itself; a failed rank's error is in torchrun's output)"
        )
    return reason


# A healthy group leaves in milliseconds. One with a collective still in flight (a stopped run whose
# peers stopped elsewhere, a lost peer) can block in destroy_process_group for good: it flushes
# in-flight NCCL collectives rather than abort them (pytorch#141510, "for a bad program, a hang is
# expected at destroy_process_group()"), and hangs in ncclCommDestroy after CUDA graph capture of
# NCCL operations (pytorch#115388). 5 s is generous for the first, and bounds the second.
TEARDOWN_TIMEOUT_S = 5.0


def teardown(ctx: DistContext) -> bool:
    """Leave the process group, waiting at most TEARDOWN_TIMEOUT_S. False when it did not finish:
    the destroy is left blocked in a daemon thread, and the caller should end the process with
    ``os._exit`` (``signals.exit_now``), since the interpreter's own exit may block on it too."""
    if not (ctx.distributed and dist.is_initialized()):
        return True
    done, failed = threading.Event(), []

    def destroy():
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # re-raised in the caller's thread, as before the bound
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=destroy, name="fastcifar-teardown", daemon=True).start()
    if not done.wait(TEARDOWN_TIMEOUT_S):
        return False
    if failed:
        raise failed[0]
    return True


@torch.no_grad()
def average_buffers(buffers, world_size: int) -> None:
    """Average floating-point buffers (batchnorm running statistics) over ranks: each rank
    normalizes with its own batch statistics in training, so their running means drift apart. One
    all-reduce per dtype (a ResNet-9 has 16 such buffers), not one per buffer."""
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in buffers:
        if buf.is_floating_point():
            by_dtype.setdefault(buf.dtype, []).append(buf)
    for bufs in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        dist.all_reduce(flat)
        flat.div_(world_size)
        for b, mean in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
            b.copy_(mean.view_as(b))


def all_sum(values: list[float], ctx: DistContext, device: torch.device) -> list[float]:
    """Sum a few scalars over ranks (epoch metrics); one collective, one host sync."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if ctx.distributed:
        dist.all_reduce(t)
    return t.tolist()


def all_gather_dealt(rows: torch.Tensor, total: int, ctx: DistContext) -> torch.Tensor:
    """A set dealt out to the ranks as evaluation deals it (rank r holds items r, r + N, r + 2N, ...
    of ``total``: ``data.loader.EvalSet``), put back together in the set's order on every rank.
    One all-gather: each rank pads its rows to the largest rank's count (the counts differ by at
    most one), and the padding lands past ``total``."""
    if not ctx.distributed:
        return rows
    most = -(-total // ctx.world_size)
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded)
    return torch.stack(parts, 1).reshape(most * ctx.world_size, *rows.shape[1:])[:total]
