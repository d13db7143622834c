"""fastcifar.train: train a CIFAR-10 network on one device or data-parallel under torchrun.

    python -m fastcifar.train --data data --download              # one GPU (or CPU), the default preset
    python -m fastcifar.train --data data --preset resnet9        # the seed recipe
    torchrun --nproc_per_node 8 -m fastcifar.train --data data --preset apple8   # 8 GPUs, one machine

Result on official CIFAR-10: the default preset clears the 94% bar over 25 seeds on one H100 in
x0.956 the time of `fast-muon9` run beside it (bench/results/official.jsonl, call "visit 12c"),
which was faster than airbench94_muon run beside it (call "visit 10b"); the record script, raced
beside `fast-muon9`, was faster still but fell short of the bar (call "visit 11"; README, Results).
Published figures to beat (theirs, each with its own timing rules): 94% in ~7.8 s on 8 V100s,
ResNet-9 "bag of tricks" ~26 s on one V100, the single-GPU speedrun scripts 1.98-2.59 s on one A100
(``bash scripts/gpu_visit.sh race`` runs them beside this trainer).

The story of one invocation: join the ranks and compare their settings, load the data (one rank
per node fetches and decodes it, the others read what it left), then for each run build the model
and optimizer, take a few untimed warm-up steps (and capture the step and evaluation as CUDA
graphs), restore the initial state (a later run whose settings differ only per run takes over the
engine an earlier run built instead, its own initial state copied in: ``run.engine``), start the
clock, set the data-dependent init (the whitening conv reads training images, so it is training
time), train epoch by epoch with the clock stopped during evaluation, and report. What a run
switches on (sparse training, checkpoints and resume, the profiler window, the model file, ...) is
a component (``run.component``) that the loop calls at fixed points; ``run.components.for_run``
chooses them.
"""

from __future__ import annotations

import copy
import sys
import time

import torch

from fastcifar import cli
from fastcifar.core import gpu, signals
from fastcifar.core.config import Config, ConfigError, check_run_length, in_steps, schedule_line, validate
from fastcifar.core.environment import environment_problem, launcher_rank
from fastcifar.core.names import printable
from fastcifar.core.options import parse_command_line
from fastcifar.core.streams import Streams
from fastcifar.data import DataError, load_dataset, rank_shard, shard_sizes
from fastcifar.data.dali import dali_decoder
from fastcifar.data.dataset import for_run
from fastcifar.data.loader import EvalSet
from fastcifar.data.subsets import chosen_mask, save_mask
from fastcifar.data.train_loader import make_train_loader, resolve_loader
from fastcifar.models import compiled
from fastcifar.models.blocks import resolve_kernels
from fastcifar.models.network import build_model
from fastcifar.ops.augment import AugmentSpec
from fastcifar.parallel import distributed
from fastcifar.parallel.sync import GradientSync, capture_blocker
from fastcifar.run import components, graphs, profiling, recipe, report, state, whitening
from fastcifar.run import engine as engines
from fastcifar.run.graphs import StaticBatch, TrainStep, make_eval_step
from fastcifar.run.progress import Progress, chunked_decoder
from fastcifar.run.report import EpochRecord, RunLog, RunResult, device_info, process_start_time, provenance, versions
from fastcifar.run.schedule import DeviceSchedule, epoch_lengths, lr_schedule
from fastcifar.run.sparse.run import SparseRun
from fastcifar.run.step import evaluate, make_step, synchronize, timed, timed_eval

PROCESS_START = process_start_time()


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.train") -> int:
    cfg, given = parse_command_line(argv, prog=prog)
    ctx = None
    code = 1  # what an unexpected error ends with
    # SIGINT/SIGTERM: one line and exit 130/143, finally blocks run; also when the main thread is
    # blocked in a collective (signals.py: a watcher thread then records the stop and ends the process)
    previous = signals.install(on_blocked=record_stop)
    try:
        problem = environment_problem()  # fastcifar-train: torch (and libgomp) loaded already, still refused
        if problem is not None:
            raise ConfigError(problem)
        ctx = distributed.setup(cfg.device, cfg.dist_timeout_s, cfg.dist_group, settings=cfg)
        # The first collective, right after the group forms: ranks launched with different command
        # lines stop here, before any file is read (a checkpoint, the data).
        distributed.check_same(distributed.config_digest(cfg), "config", ctx)
        if cfg.resume:  # the checkpoint's settings (rank 0 reads them); the options given must agree
            cfg = state.resume_settings(cfg, given, ctx)
        run(cfg, ctx)
        code = 0
    except (ConfigError, DataError) as exc:
        where = f"[rank {ctx.rank}] " if ctx is not None and ctx.distributed else ""
        if not isinstance(exc, distributed.PeerDataError):  # a peer's own failure: it told the others
            distributed.announce_stop(ctx, str(exc))  # ranks waiting for this one's data stop waiting
        report.stop_open_logs("failed", str(exc))
        print(f"fastcifar: error: {where}{printable(str(exc))}", file=sys.stderr)  # one line, whatever it quotes
        code = 2
    except BrokenPipeError:  # `fastcifar train ... | head`: the reader left; recorded, then quiet (141)
        distributed.announce_stop(ctx, "rank 0's stdout was closed by its reader (broken pipe)")
        report.stop_open_logs("failed", "stdout closed by its reader (broken pipe)")
        code = signals.stdout_gone()
    except signals.StopRun as exc:  # interrupted (130, 143) or diverged (4): logs closed, summary written
        code = signals.end_run(exc, record_stop)
    except RuntimeError as exc:
        if not distributed.is_comm_failure(exc):
            distributed.announce_stop(ctx, f"{type(exc).__name__}: {exc}")
            raise
        # Another rank died or stalled. No teardown: a broken group can block in it; exiting frees it.
        # one line, also when the watchdog sees the stall in the same second (it then prints it)
        if not distributed.report_failure(
            f"fastcifar: error: [rank {launcher_rank()}] {distributed.failure_message(exc, cfg.dist_timeout_s)}"
        ):
            signals.wait_for_claimant()
        report.stop_open_logs("failed", distributed.failure_message(exc, cfg.dist_timeout_s))
        ctx = None
        code = 3
    except Exception as exc:  # a bug: the traceback follows (exit 1); the others stop waiting for this rank
        distributed.announce_stop(ctx, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        try:
            if ctx is not None and not distributed.teardown(ctx):  # stuck on a collective in flight
                signals.exit_now(code, sys.exc_info()[1])  # the interpreter's exit could block on it too
        finally:  # last, so the teardown is not interrupted; also when it raises (a Ctrl-C during it)
            signals.restore(previous)  # the caller's Ctrl-C works again
    return code


def record_stop(exc: signals.StopRun) -> None:
    """An early stop in log.txt and summary.json, and its one line (rank 0): by the main thread, or
    by the signal watcher when the main thread is blocked and cannot."""
    report.stop_open_logs(type(exc).__name__.lower(), distributed.stop_reason(exc))
    if launcher_rank() == "0":
        print(f"fastcifar: {exc}", file=sys.stderr, flush=True)


def run(cfg: Config, ctx: distributed.DistContext, reuse: engines.Reuse | None = None) -> list[RunResult]:
    """Check the settings, then train: the command line and ``fastcifar.train(cfg)`` both come here
    (``reuse``: ``train``'s)."""
    # Before validate: ranks given different settings all stop here, none validates alone (the
    # Python API's first collective; the command line's second, after --resume's settings).
    distributed.check_same(distributed.config_digest(cfg), "config", ctx)
    validate(cfg, ctx.world_size)
    return train(cfg, ctx, reuse=reuse)


def train(
    cfg: Config, ctx: distributed.DistContext, warmup_runs: int = 0, reuse: engines.Reuse | None = None
) -> list[RunResult]:
    """``cfg.runs`` runs, logged and summarized; ``warmup_runs`` whole runs before them that are
    neither logged nor returned (bench/bench_train.py: caches, clocks and allocator settle).
    ``reuse``: what earlier calls left for this one, and where this one leaves its data set and
    engine for later calls (``run.engine``: the sweep worker's); None: kept for this call's runs only."""
    reuse = engines.Reuse() if reuse is None else reuse
    # first: a --cuda-graphs on that cannot work is refused before anything is read or written
    use_graphs, graphs_note = graphs.resolve(
        cfg.cuda_graphs, ctx.device, capture_blocker(cfg, ctx.world_size, ctx.distributed)
    )
    # fp16 on the CPU is emulated: the README's CPU example finished no epoch in 300 s (fp32: under a minute)
    if cfg.precision == "fp16" and ctx.device.type == "cpu":
        raise ConfigError(
            "--precision fp16 on the CPU runs half precision in software, many times slower than fp32 "
            "(the README's CPU example finished no epoch in 300 s): use --precision fp32 "
            "or auto (fp32 on the CPU), or --device cuda"
        )
    resume = state.load_state(cfg.resume, cfg, ctx) if cfg.resume else None  # refused before any write
    log = RunLog(cfg, cfg.out_dir, enabled=ctx.is_main)  # checks --out-dir; the folder comes at log.start
    progress = Progress.for_rank(ctx.is_main, cfg.quiet)
    half = cfg.precision == "fp16" or (cfg.precision == "auto" and ctx.device.type == "cuda")
    dtype = torch.float16 if half else torch.float32
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest conv algorithm once
    determinism = distributed.apply_determinism(cfg, ctx.device)  # --deterministic: what it covers, in one line

    kernels = resolve_kernels(cfg.kernels, ctx.device, cfg.fused_conv)  # refused before anything is written
    components.check(cfg)  # an option's library that cannot be imported (--tensorboard): one line, nothing written
    loader_name, notice = resolve_loader(cfg.loader, ctx.device)
    for note in (
        determinism,
        report.cpu_note(cfg, ctx.device),
        report.cpu_threads_note(ctx.device),
        notice,
        graphs_note,
        profiling.graphs_note(cfg.nvtx, use_graphs),
    ):
        if note:
            log.line(note)

    # Data: local rank 0 of each node reads the set first, alone fetching it (--download) and writing
    # the decode cache; the node's other ranks then read what it left. Every rank keeps its fixed
    # shard on the device and takes the same number of steps.
    decode = dali_decoder(ctx.device) if loader_name == "dali" else None  # JPEG folders: DALI decodes once
    if progress.enabled:
        decode = chunked_decoder(decode, progress)

    def read_data(first: bool):  # first: local rank 0 of the node
        return load_dataset(
            cfg.data,
            cfg.download,
            cfg.cache_dir or None,
            log=log.line,
            decode=decode,
            download_set=cfg.download_set,
            write=first,
        )

    doing = "downloading or reading the data" if cfg.download else "reading the data"
    read = reuse.read(  # read once per process for the same data settings (a sweep worker's later runs)
        (cfg.data, cfg.download, cfg.download_set, cfg.cache_dir, loader_name),
        lambda: distributed.load_once_per_node(read_data, ctx, doing, distributed.data_timeout(cfg.dist_timeout_s)),
    )
    subset = chosen_mask(cfg, read.n_read, Streams.for_run(cfg, cfg.seed).subset)  # one for all --runs
    # the subset, then --val-split's held-out images, before any sharding; every rank's before the
    # model handshake; ``read`` stays whole for --save-outputs train
    data, val_images, val_labels, notes = for_run(read, cfg.subset, cfg.val_split, subset)
    # whose shard and draws this rank trains on: its own (the harness's --rank0-data: rank 0's)
    data_rank, data_world = distributed.data_ranks(cfg, ctx)
    per_rank_batch = cfg.batch_size // data_world
    # a rank's shard is its share of the whole set as read, less what the subset leaves out: the
    # steps follow the smallest shard (the emulated ranks' too); the whole set: n // batch, as ever
    shards = data_world * cfg.emulate_ranks
    steps = min(shard_sizes(data.index, data.n_read, shards)) // (cfg.batch_size // shards)
    cfg = in_steps(cfg, steps)  # --steps N: the epochs that make N steps
    check_run_length(cfg, steps, len(data.train_labels), ctx.world_size)  # 1..MAX_STEPS steps in all
    shard = rank_shard(data.index, data.n_read, data_rank, data_world)
    train_loader = make_train_loader(
        loader_name,
        data.train_images,
        data.train_labels,
        shard,
        per_rank_batch,
        steps,
        augment=AugmentSpec.from_config(cfg),
        kernels=kernels,
        dtype=dtype,
        device=ctx.device,
        rank=data_rank,
        emulate_ranks=cfg.emulate_ranks,
        index=data.index,
        n_read=data.n_read,
    )  # N ranks' side by side
    test_set = EvalSet(
        data.test_images,
        data.test_labels,
        cfg.eval_batch_size,
        dtype=dtype,
        device=ctx.device,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    # each epoch's evaluation: the test set, or --val-split's held-out images (the test set then once, at the end)
    eval_set = (
        test_set
        if not len(val_labels)
        else EvalSet(
            val_images,
            val_labels,
            cfg.eval_batch_size,
            dtype=dtype,
            device=ctx.device,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
    )
    schedule_text, schedule = schedule_line(cfg, steps)
    engine = {
        "loader": loader_name,
        "kernels": kernels,
        "precision": "fp16" if half else "fp32",
        "cuda graphs": "on" if use_graphs else "off",
    }
    if cfg.fused_conv:
        engine["conv"] = "fused with the batchnorm statistics"
    if cfg.optimizer == "muon":  # its precision follows the GPU's compute capability (core.gpu)
        engine["newton-schulz"] = str(gpu.newton_schulz_dtype(ctx.device)).removeprefix("torch.")
    if ctx.distributed:
        engine["comm"] = cfg.comm
    # the class names once, as "classes" (the header shows a few; log.txt and summary.json all)
    log.start(
        {
            "versions": versions(),
            "device": device_info(ctx.device, ctx.world_size),
            "provenance": provenance(cfg, ctx.device) if ctx.is_main else {},
            "data": f"{data.source}: {len(data.train_labels)} train, "
            + (f"{len(val_labels)} validation, " if len(val_labels) else "")
            + f"{len(data.test_labels)} test images, {len(data.classes)} classes",
            "steps_per_epoch": steps,
            "schedule": schedule,
            "per_rank_batch": per_rank_batch,
            "engine": engine,
            "classes": list(data.classes),
        }
    )
    log.follow(distributed.from_rank0(str(log.dir or ""), ctx), ctx.rank)  # a killed rank 0 still gets a summary
    if log.dir is not None:  # the images this invocation trains on, for a study to read back
        save_mask(log.dir, data.mask())

    for note in [*notes, schedule_text, report.emulated_note(cfg)]:  # after the header: the run's own settings
        if note:
            log.line(note)
    # what an engine is built from (run.engine): a later run whose settings give the same key takes it over
    engine_key = engines.key(cfg, ctx, steps, len(test_set.labels), len(data.classes), use_graphs)
    session = components.Session(
        cfg,
        ctx,
        dtype,
        train_loader,
        test_set,
        log,
        progress,
        use_graphs,
        tuple(data.classes),
        resume,
        eval_set,
        read,
        reuse=reuse,
        engine_key=engine_key,
    )
    quiet = components.Session(
        cfg,
        ctx,
        dtype,
        train_loader,
        test_set,
        RunLog(cfg, "", False),
        Progress(False),
        use_graphs,
        tuple(data.classes),
        None,
        eval_set,
        reuse=reuse,
        engine_key=engine_key,
    )  # a warm-up run: no logs, no bars
    for _ in range(warmup_runs):  # seed + runs: a seed no measured run uses
        train_one_run(quiet, 0, cfg.seed + cfg.runs)
    results = []
    for run in range(1, cfg.runs + 1):
        results.append(train_one_run(session, run, cfg.seed + run - 1))
        log.run_done(results[-1], cfg.target_acc)
    log.finish(results)
    return results


def train_one_run(session: components.Session, run: int, seed: int) -> RunResult:
    """Run ``run`` (0: an unlogged warm-up run) of the session, seeded ``seed``."""
    # From the run's first collective on, a peer lost ends this rank within --dist-timeout-s (one
    # line, exit 3): in the model handshake, warm-up and graph capture too (the steps beat it).
    with components.Watchdog(session) as watchdog:
        return _train_one_run(session, run, seed, watchdog)


def _train_one_run(session: components.Session, run: int, seed: int, watchdog: components.Watchdog) -> RunResult:
    cfg, ctx, loader, log = session.cfg, session.ctx, session.train_loader, session.log
    set_up = time.perf_counter()  # what the user waits for before the clock starts (RunResult.setup_time)
    streams = Streams.for_run(cfg, seed)  # init, order, aug: each its own (core.streams)
    # an earlier run's engine, when nothing it was built from differs (run.engine): this run's
    # initial weights, momentum and schedule go into it in place; no build, warm-up or capture
    engine = session.reuse.take(session.engine_key)
    if engine is None:
        engine, sparse = build_engine(session, run, seed, streams, watchdog)
    else:
        engine.restart(initial_model(session, streams))
        sparse = SparseRun(cfg, engine.model, engine.opt, loader, ctx, log, run, seed)  # diffs; no masks here
    model, sync, opt, schedule = engine.model, engine.sync, engine.opt, engine.schedule
    train_step, eval_step = engine.train_step, engine.eval_step
    # DALI, the Triton augmentation: each batch written into the step's buffers (a kept engine's too)
    loader.bind_static(train_step.batch.images, train_step.batch.labels)
    per_rank_batch, steps = loader.batch_size, len(loader)
    lengths = epoch_lengths(cfg.epochs, steps)  # a fractional --epochs cuts the last one short
    hooks = recipe.RunHooks(cfg, model, loader)  # lookahead
    network_parts = whitening.for_model(cfg, model, opt, loader, ctx, train_step)  # its whitening conv's, if any
    push, pop = profiling.markers(cfg.nvtx)
    step_s, eval_s = engine.step_s, engine.eval_s

    parts = dict(ctx=ctx, model=model, opt=opt, schedule=schedule, hooks=hooks, loader=loader)
    run_parts = components.for_run(session, run, network_parts, parts, sync, sparse, lengths, eval_step, watchdog)
    result = RunResult(run=run, seed=seed, test_acc=0.0, train_time=0.0, wall_time=0.0, streams=streams.as_dict())
    start_epoch = run_parts.start(result)  # a resumed run: as after its checkpoint's epoch
    # the run's first line: what it will take in all, from the step and evaluation timed when its
    # engine was built (build_engine); with --val-split the test set's one evaluation after the last
    # epoch too
    todo, eval_batches = lengths[start_epoch:], len(session.eval_set)
    final_batches = len(session.test_set) if session.eval_set is not session.test_set else 0
    result.estimated_time = report.estimate(
        time.perf_counter() - set_up, todo, step_s, eval_batches * len(todo) + final_batches, eval_s
    )
    log.line(report.estimate_line(run, result.estimated_time, todo, step_s, eval_batches, eval_s, final_batches))
    total_train_time = result.epochs[-1].total_train_time if result.epochs else 0.0
    for epoch in range(start_epoch, len(lengths)):
        epoch_steps = lengths[epoch]
        loader.set_epoch(streams, epoch)
        model.train()
        train_step.reset()
        synchronize(ctx.device)
        t0 = time.perf_counter()
        if epoch == start_epoch:  # the clock starts: what came before it is the run's set-up
            result.setup_time = t0 - set_up
        run_parts.epoch_start(epoch)  # on the clock: epoch 0's data-dependent inits read training images
        batches = profiling.ranged(loader.first(epoch_steps), "data", push, pop)
        bar = f"run {run} epoch {epoch + 1}/{len(lengths)}"
        for images, labels in session.progress.steps(batches, epoch_steps, bar):
            push("step")  # a graph replay shows as this one range: its phases were marked at capture
            train_step(images, labels)
            pop()
            run_parts.after_step()
        if epoch + 1 < len(lengths):  # the next epoch's draws, while the GPU runs this one's queued steps
            loader.prepare(streams, epoch + 1)
        run_parts.epoch_end(epoch)
        synchronize(ctx.device)
        epoch_time = time.perf_counter() - t0
        total_train_time += epoch_time

        t1 = time.perf_counter()
        distributed.average_buffers(model.buffers(), ctx.world_size)
        test_loss, test_acc = evaluate(  # --val-split: held-out images
            model, eval_step, session.eval_set, ctx, session.progress, f"run {run} epoch {epoch + 1} evaluation"
        )
        n_train = epoch_steps * per_rank_batch * ctx.world_size
        train_loss, train_correct = distributed.all_sum(
            [train_step.loss_sum.item(), float(train_step.correct.item())], ctx, ctx.device
        )
        record = EpochRecord(
            run=run,
            epoch=epoch + 1,
            lr=schedule.value(sum(lengths[: epoch + 1]) - 1) * per_rank_batch,
            train_time=epoch_time,
            train_loss=train_loss / n_train,
            train_acc=100.0 * train_correct / n_train,
            test_time=time.perf_counter() - t1,
            test_loss=test_loss,
            test_acc=test_acc,
            total_train_time=total_train_time,
        )
        result.epochs.append(record)
        log.epoch(record)
        run_parts.epoch_done(epoch, record)  # off the clock: sparse diffs, the divergence guard, checkpoints
    result.test_acc = result.epochs[-1].test_acc
    result.train_time = total_train_time
    result.wall_time = time.time() - PROCESS_START
    result.model, result.classes = model, tuple(session.classes)
    run_parts.finish(result)  # the test set after --val-split, the whitening bias trainable again, the model file, ...
    result.run_time = time.perf_counter() - set_up  # the last line of the run gives it (log.run_done)
    if session.reuse.keep(engine):  # a later run trains the live model: this run's result is a copy
        result.model = engine.model_copy()
    else:
        model.zero_grad(set_to_none=True)
    return result


def initial_model(session: components.Session, streams: Streams):
    """The run's network with its initial weights: the same on every rank, and the same whether it
    is trained itself or copied into an earlier run's engine (``run.engine``)."""
    torch.manual_seed(streams.init)
    return build_model(session.cfg, session.ctx.device, session.dtype, num_classes=len(session.classes))


def build_engine(
    session: components.Session, run: int, seed: int, streams: Streams, watchdog: components.Watchdog
) -> tuple[engines.Engine, SparseRun]:
    """The run's model, optimizer and steps, built, warmed up and captured off the clock, then put
    back to their initial state; and the run's sparse-training component, which may wrap the optimizer."""
    cfg, ctx, loader, log = session.cfg, session.ctx, session.train_loader, session.log
    model = initial_model(session, streams)
    distributed.check_same(distributed.model_digest(model), "model's parameter shapes", ctx)
    sync = GradientSync(model, cfg, ctx, seed)  # DDP, gradient buckets (compressed or not), or nothing
    for line in sync.lines if run == 1 else ():
        log.line(line)
    net = compiled.wrap(sync.net, cfg.compile)  # --compile: torch.compile, compiled in the warm-up steps below
    # Loss summed over the rank's batch, so the step is divided by the per-rank batch (see config.py).
    per_rank_batch, steps = loader.batch_size, len(loader)
    peak = recipe.peak_rate(cfg, per_rank_batch)
    schedule = DeviceSchedule(lr_schedule(cfg, steps, peak), ctx.device)
    opt = recipe.make_optimizer(model, cfg, per_rank_batch, peak, ctx)  # NesterovSGD, or Muon + SGD
    sparse = SparseRun(cfg, model, opt, loader, ctx, log, run, seed)  # masks, diffs, local SGD
    opt = sparse.optimizer  # masked when --sparse-mask is set
    step = make_step(
        net,
        opt,
        schedule,
        cfg.label_smoothing,
        profiling.markers(cfg.nvtx),
        sync.buckets,
        watchdog.dog.beat,
        cfg.grads_to_none,
    )
    train_step = TrainStep(step, StaticBatch(per_rank_batch, session.dtype, ctx.device), capture=session.use_graphs)
    loader.bind_static(train_step.batch.images, train_step.batch.labels)
    # the evaluation's buffers hold its largest batch, not always --eval-batch-size rows: --subset 2000's 400
    # test images fill 400, where 1,000 rows of which 600 were zeros ran through every TTA view
    eval_rows = max(session.eval_set.largest_batch, session.test_set.largest_batch, 1)
    eval_step = make_eval_step(  # --tta-scope test: the share over the rank's whole test set
        model,
        StaticBatch(eval_rows, session.dtype, ctx.device),
        cfg.tta,
        capture=session.use_graphs,
        tta_share=cfg.tta_share,
        tta_scope=cfg.tta_scope,
        test_rows=len(session.test_set.labels),  # the final evaluation's, the one on the clock
    )
    engine = engines.Engine(session.engine_key, model, sync, opt, schedule, train_step, eval_step)

    # Off the clock: warm-up steps (cuDNN's algorithm search, first allocations) and graph capture
    # on a real batch; then weights, batchnorm statistics, momentum and the schedule go back to
    # their initial values, in place, so the captured graphs still point at them.
    initial = copy.deepcopy(model.state_dict())
    loader.set_epoch(streams, 10**6)  # an epoch index training never uses
    train_step.batch.load(*next(iter(loader)))
    loader.quiesce()  # DALI's threads must make no CUDA calls during capture
    model.train()
    with session.progress.stage(f"run {run}: warm-up" + (" and graph capture" if session.use_graphs else "")):
        train_step.warm_up_and_capture(cfg.warmup_steps)
        for part in whitening.for_model(cfg, model, opt, loader, ctx, train_step):  # its whitening conv's, if any
            part.warm_up(cfg.warmup_steps)  # the step after the whitening bias freezes; cuSOLVER's first load
    step_s = timed(train_step, ctx.device)  # one more step, for the run's estimate; undone by the restore below
    model.load_state_dict(initial)
    opt.reset_state()
    schedule.reset()
    sync.reset()  # error-feedback residuals, compression RNG and counts
    model.eval()
    eval_step.batch.load(*next(iter(session.eval_set)))
    eval_step.prepare()
    eval_s = timed_eval(eval_step, ctx.device)  # an evaluation batch, or a slice of it scaled, for the estimate
    engine.started(step_s, eval_s)
    return engine, sparse


# `fastcifar.train(cfg)` calls the API whether or not this module was imported first (fastcifar.cli).
cli.make_callable(__name__, "fastcifar.api:train")

if __name__ == "__main__":
    sys.exit(main())
