"""Every setting of a run, in one dataclass whose fields carry their own --help; the checks that
refuse settings that cannot work; a run folder's settings file, written and read back.

Learning-rate rule: ``lr`` is the peak rate for the mean loss at 512 images of global batch, and
scales linearly with the global batch (``peak = lr * batch_size / 512``), so a preset keeps its
dynamics when the same global batch is split over more ranks. The trainer sums the loss over a
rank's batch (fp16 gradients stay well above underflow that way) and divides the rate by the
per-rank batch, which is the same update.

The field defaults are the seed recipe (preset ``resnet9``); a preset (fastcifar.core.presets)
lists only the fields it changes, and ``from_preset`` builds its Config. The command line
(fastcifar.core.options) starts from ``DEFAULT_PRESET`` and has one flag per field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from fastcifar.core.errors import ConfigError
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS
from fastcifar.core.streams import STREAMS, UNSET

# --help's groups, in the order it lists them: each field names one (``setting(group=...)``).
HELP_GROUPS = {
    "basic": "basic options",
    "data": "data",
    "model": "model",
    "recipe": "recipe",
    "parity": "recipe: airbench94 parity and Muon",
    "engine": "engines",
    "distributed": "distributed (torchrun)",
    "compress": "compressed gradient communication",
    "sparse": "sparse training and local SGD",
    "checkpoints": "checkpoints and model files",
    "output": "output and logging",
    "experiments": "controlled experiments: seed streams, subsets, outputs, determinism (docs/experiments.md)",
    # the test harness's switches: a flag each, left out of --help (they change what a run means)
    "testing": None,
}


def setting(default: Any, help: str, group: str | None) -> Any:
    """A Config field: its default, its --help text (units and choices) and its --help group; a
    field of group None has no flag of its own."""
    if group is not None and group not in HELP_GROUPS:
        raise AssertionError(f"no --help group {group!r}; the groups: {', '.join(HELP_GROUPS)}")
    return field(default=default, metadata={"help": help, "group": group})


@dataclass
class Config:
    # data
    data: str = setting("data", "official archive/folder, or image folder / .tar.gz of train/ and test/", group="basic")
    download: bool = setting(False, "fetch official CIFAR-10 into --data when absent (MD5-checked)", group="basic")
    download_set: str = setting(
        "cifar10", "which official set --download fetches: cifar10 | cifar100 (fine labels)", group="data"
    )
    cache_dir: str = setting("", 'decoded-image cache; "" = next to the data, else ~/.cache/fastcifar', group="data")
    subset: int = setting(
        0,
        "training images to use: a fixed sample, the same for every seed (a study: --subset-fraction or "
        "--subset-mask); 0 = all; the test set is cut to the same fraction",
        group="basic",
    )
    val_split: int = setting(
        0,
        "training images held out (fixed, seeded) for the per-epoch evaluation; the test set is then evaluated once, "
        "at the end; 0 = evaluate on the test set every epoch",
        group="data",
    )
    loader: str = setting(
        "auto",
        "dali | torch (plain torch ops on device-resident uint8) | auto: torch on CUDA, dali on the CPU (the faster "
        "measured: fastcifar.data.train_loader.AUTO_LOADER)",
        group="data",
    )
    # model (fields marked "fastnet:" act with --arch fastnet only)
    arch: str = setting(
        "resnet9",
        "network: resnet9 (fastcifar.models.resnet9) | fastnet (fastcifar.models.fastnet) | alexnet "
        "(fastcifar.models.alexnet)",
        group="model",
    )
    widths: tuple = setting(
        (64, 128, 256, 512),
        "channels (each 1..4096): resnet9 prep,layer1,layer2,layer3; fastnet its 3 blocks; alexnet its 5 convs",
        group="model",
    )
    whiten_kernel: int = setting(
        2, "fastnet: side of the patches its first conv whitens (2*3*side^2 channels)", group="model"
    )
    whiten_eps: float = setting(
        5e-4, "fastnet: added to each patch eigenvalue before the 1/sqrt scaling (damps smaller ones)", group="model"
    )
    activation: str = setting(
        "gelu", "fastnet: after the whitening conv and every batchnorm: gelu | silu | relu | celu", group="model"
    )
    whiten_images: int = setting(
        5000, "fastnet: training images whose patches set the first conv, on the clock; 0 = random init", group="model"
    )
    whiten_frozen: bool = setting(True, "fastnet: the whitening conv's weights are not trained", group="model")
    whiten_bias_epochs: float = setting(
        3,
        "fastnet: epochs the whitening conv's bias trains before it is frozen; a fraction freezes it mid-epoch, at "
        "step ceil(epochs x steps per epoch) (0.19: the record script's)",
        group="model",
    )
    whiten_bias_decay: bool = setting(
        False,
        "fastnet: the whitening bias's rate falls linearly to 0 over its --whiten-bias-epochs window (x the run's "
        "schedule), as in airbench94_muon; off: it follows the run's schedule until frozen",
        group="model",
    )
    bn_momentum: float = setting(
        0.1, "weight of each batch in batchnorm's running statistics (torch convention)", group="model"
    )
    bn_scale_frozen: bool = setting(False, "batchnorm scales stay 1 (not trained); the shifts train", group="model")
    # recipe
    epochs: float = setting(
        24,
        "passes over the training set, in (0, 1000]; a fraction cuts the last one short (9.9: ceil(9.9 x steps) steps)",
        group="basic",
    )
    batch_size: int = setting(512, "images per step (1..65536), global: split evenly over the ranks", group="basic")
    lr: float = setting(
        0.4,
        "peak rate for the mean loss, per 512 images of global batch: the run peaks at lr x batch-size / 512 (the "
        "log's lr column)",
        group="basic",
    )
    warmup_epochs: float = setting(
        5.0,
        "from lr-start x peak up to the peak, then to lr-end x peak; scales with --epochs unless given",
        group="recipe",
    )
    lr_start: float = setting(0.0, "rate at the first step, as a fraction of the peak", group="recipe")
    lr_end: float = setting(0.0, "rate at the last step, as a fraction of the peak", group="recipe")
    bias_lr_scale: float = setting(
        1.0, "batchnorm shifts: rate x this, weight decay / this (same decay per step)", group="recipe"
    )
    momentum: float = setting(0.9, "SGD momentum, in [0, 1)", group="recipe")
    nesterov: bool = setting(True, "Nesterov momentum", group="recipe")
    weight_decay: float = setting(
        5e-4,
        "per example (the step multiplies it by the per-rank batch, as it sums the loss: docs/presets.md, "
        "learning-rate rule)",
        group="recipe",
    )
    label_smoothing: float = setting(0.2, "cross-entropy label smoothing", group="recipe")
    lookahead_steps: int = setting(
        0, "every this many steps slow weights move toward the trained ones and replace them; 0 = off", group="recipe"
    )
    lookahead_decay: float = setting(
        0.7738, "slow weights' share at the last sync (0.95^5), ramping up from 0 as progress^3", group="recipe"
    )
    crop_pad: int = setting(4, "random crop from this many pixels of padding per side", group="recipe")
    pad_mode: str = setting("reflect", "padding for the random crop: reflect | zero", group="recipe")
    flip: bool = setting(True, "horizontal flip, half of the images per epoch", group="recipe")
    flip_mode: str = setting(
        "random",
        "random: a coin per image per epoch | alternate: a coin per image, mirrored every other epoch",
        group="recipe",
    )
    cutout: int = setting(8, "side of the zeroed square, pixels; 0 = off", group="recipe")
    brightness: float = setting(
        0.0,
        "jitter: each training image, normalized, plus a uniform draw in [-B, B] (units of each channel's std); 0 = "
        "off",
        group="recipe",
    )
    contrast: float = setting(
        0.0, "jitter: then times a uniform draw in [1 - C, 1 + C], one per image; 0 = off", group="recipe"
    )
    tta: int = setting(
        1,
        "test-time augmentation: 0 none | 1 mean logits of image and mirror | 2 also 1-px shifts (6 views)",
        group="recipe",
    )
    tta_share: float = setting(
        1.0,
        "share of each evaluation batch (per rank; of the rank's test set with --tta-scope test) given the TTA views, "
        "least confident first (the plain view's top probability); the rest count the plain view",
        group="recipe",
    )
    tta_scope: str = setting(
        "batch",
        "where --tta-share < 1 picks its least confident images: batch (within each evaluation batch) | test (over "
        "the rank's whole test set, as the record script does: a plain pass over it all first)",
        group="recipe",
    )
    # recipe: airbench94's conventions, and Muon
    bn_eps: float = setting(
        1e-5, "added to the batch variance in batchnorm (torch: 1e-5; airbench: 1e-12)", group="parity"
    )
    whiten_centred: bool = setting(
        False, "fastnet: whiten with the patches' covariance (centred), not their second moment", group="parity"
    )
    lr_at: str = setting(
        "end",
        "step i's rate: end (at progress (i+1)/steps of its epoch) | start (at i of ceil(epochs x steps), warm-up "
        "floored to whole steps: airbench)",
        group="parity",
    )
    lookahead_start_epoch: int = setting(
        0, "lookahead's slow copy taken at the first sync step of this epoch; 0 = at the start", group="parity"
    )
    lookahead_epoch_end: str = setting(
        "fold",
        "at epoch ends: fold (the run's last sync folds in the steps since the one before) | reset (every epoch end "
        "from the start epoch: weights <- slow copy, airbench)",
        group="parity",
    )
    optimizer: str = setting(
        "sgd",
        "sgd (Nesterov SGD on everything) | muon (conv filters: orthogonalized momentum, fastcifar.run.optim.Muon; "
        "the rest: Nesterov SGD)",
        group="parity",
    )
    muon_lr: float = setting(
        0.24,
        "muon: a filter's step at the peak, x its orthogonalized update (weights renormalized to sqrt(out channels))",
        group="parity",
    )
    muon_momentum: float = setting(0.6, "muon: Nesterov momentum of the filters", group="parity")
    muon_ns_steps: int = setting(3, "muon: Newton-Schulz iterations per orthogonalization", group="parity")
    newton_schulz: str = setting(
        "loop",
        "muon: loop (one stack per filter shape) | stacked (every filter zero-padded into one stack: one set of "
        "kernels a step; the same map, to rounding)",
        group="engine",
    )
    muon_shard: bool = setting(
        False,
        "muon, several ranks: each orthogonalizes every world-th filter, one all-reduce shares them",
        group="distributed",
    )
    head_lr_scale: float = setting(
        1.0, "the linear head: rate x this, weight decay / this (same decay per step)", group="parity"
    )
    logit_scale: float = setting(0.0, "fastnet: logits x this; 0 = 1/9 (airbench94)", group="parity")
    head_unit_init: bool = setting(
        False, "fastnet: head weights rescaled to standard deviation 1 at init (fast-muon)", group="parity"
    )
    # sparse training and local SGD (fastcifar.run.sparse, fastcifar.parallel.local_sgd)
    sparse_mask: str = setting(
        "none", "which parameters train: none (all) | fisher (top Fisher scores) | random (same count)", group="sparse"
    )
    sparse_fraction: float = setting(
        0.02, "K: fraction of the trainable parameters in the mask (classifier/BN shifts on top)", group="sparse"
    )
    mask_samples: int = setting(
        1024, "N: training images whose per-sample gradients score the parameters (split over ranks)", group="sparse"
    )
    mask_score: str = setting(
        "squared",
        "Fisher score per sample: squared grad at the true label | abs | expected (over the model's labels)",
        group="sparse",
    )
    mask_every: int = setting(
        0, "recompute the mask every this many epochs; 0 = one mask for the whole run", group="sparse"
    )
    mask_bn_shifts: bool = setting(
        True, "batchnorm shifts always train (else they compete for the mask like the rest)", group="sparse"
    )
    sparse_update: str = setting(
        "full", "full: mask gradient, weight decay and momentum | grad: the gradient only", group="sparse"
    )
    sparse_checkpoints: bool = setting(
        False, "write a base model file and a sparse diff per epoch (run dir, sparse/)", group="sparse"
    )
    local_steps: int = setting(
        0, "H: local SGD, ranks merge weights every H steps instead of all-reducing gradients; 0 = off", group="sparse"
    )
    merge: str = setting("mean", "local SGD: combine the ranks' changes by mean | sum", group="sparse")
    mask_layout: str = setting(
        "shared", "local SGD masks: shared (one mask) | disjoint (top W*K dealt round-robin over ranks)", group="sparse"
    )
    local_momentum: str = setting("keep", "local SGD: momentum after a merge: keep | reset (zeroed)", group="sparse")
    # engine
    device: str = setting("auto", "auto (cuda when available) | cuda | cpu", group="basic")
    kernels: str = setting(
        "auto", "triton (fused BN+act+pool, augmentation) | torch (reference) | auto: triton on CUDA", group="engine"
    )
    precision: str = setting("auto", "auto (fp16 on cuda, fp32 on cpu) | fp16 | fp32", group="engine")
    comm: str = setting(
        "bucketed",
        "gradient averaging over ranks: bucketed (fastcifar.parallel.comm, overlapped) | ddp (stock)",
        group="distributed",
    )
    bucket_mb: float = setting(
        2.0,
        "MiB of gradients per all-reduce bucket (--comm bucketed), see fastcifar.parallel.comm",
        group="distributed",
    )
    cuda_graphs: str = setting(
        "auto", "capture the train step and eval batch as CUDA graphs: auto (on for CUDA) | on | off", group="engine"
    )
    eval_batch_size: int = setting(
        1000,
        "images per evaluation batch, per rank (1..65536); with --tta-share < 1 and --tta-scope batch it decides "
        "which images share the views",
        group="engine",
    )
    warmup_steps: int = setting(
        3, "untimed training steps before the clock starts (0..1000); state restored after", group="engine"
    )
    dist_timeout_s: float = setting(300.0, "a collective waiting longer than this fails the run", group="distributed")
    dist_group: str = setting(
        "auto",
        "process group: auto (only with several ranks) | always (also for one rank: its gradient buckets, comm "
        "stream and captured collectives run, as on several)",
        group="distributed",
    )
    emulate_ranks: int = setting(
        1,
        "one process trains what N ranks train (each rank's shard and draws, batchnorm statistics per rank over "
        "batch/N, gradients averaged): the N-GPU recipe's accuracy on one device "
        "(fastcifar.data.loader.EmulatedRanks); 1 = off",
        group="distributed",
    )
    compile: bool = setting(
        False,
        "run the model through torch.compile, Triton kernels as custom ops (fastcifar.models.compiled)",
        group="engine",
    )
    grads_to_none: bool = setting(
        False,
        "after each step drop the gradients of the parameters being trained (set_to_none) instead of zeroing them in "
        "place, so backward hands its weight gradients over: no memset and no accumulating add per filter (7 adds "
        "on strided operands, 0.155 ms of the default's 2000-image step on an H100: visits/visit-12.md, 12d); the "
        "same weights bit for bit; bucketed ranks keep theirs in place (their buckets own them)",
        group="engine",
    )
    fused_conv: bool = setting(
        False,
        "the blocks' convs as Triton implicit GEMMs that take the batchnorm statistics (and a pool-first block's 2x2 "
        "pool) in their epilogue (fastcifar.kernels.conv_stats); needs the Triton kernels; slower than cuDNN so far "
        "(bench/results/visits/visit-11.md)",
        group="engine",
    )
    # compressed gradient communication (fastcifar.parallel.compress; several ranks, --comm bucketed)
    compress: str = setting(
        "none",
        "none (plain all-reduce) | fp16 | bf16 | topk | randomk | threshold | terngrad | qsgd | powersgd",
        group="compress",
    )
    compress_ratio: float = setting(
        0.01, "topk/randomk: fraction K of each chunk's coordinates sent, 0 < K <= 1", group="compress"
    )
    compress_threshold: float = setting(
        1e-3, "threshold: send |g_i| >= V (units of the summed-loss gradient)", group="compress"
    )
    qsgd_levels: int = setting(127, "qsgd: quantization levels s (int8 on the wire up to 127)", group="compress")
    powersgd_rank: int = setting(4, "powersgd: rank r of the P Q^T approximation", group="compress")
    compress_scope: str = setting(
        "bucket",
        "what one compressor call sees: layer (each parameter) | bucket | model (one vector per dtype)",
        group="compress",
    )
    error_feedback: bool = setting(True, "add what compression dropped to the next step's gradient", group="compress")
    compress_warmup_steps: int = setting(0, "steps averaged uncompressed before compression starts", group="compress")
    compress_transport: str = setting(
        "sparse",
        "sparse: payloads only (all-reduce or all-gather) | dense: the seed's zero-filled all-reduce",
        group="compress",
    )
    randomk_unbiased: bool = setting(
        False,
        "randomk: values x d/k (unbiased; pair with --no-error-feedback) | off: the seed's unscaled",
        group="compress",
    )
    terngrad_clip: bool = setting(
        False, "terngrad: clip to +-2.5 standard deviations before ternarizing", group="compress"
    )
    nvtx: bool = setting(
        False, "NVTX ranges around data, forward, backward, optimizer (for nsys); off: no CUDA calls", group="output"
    )
    profile_steps: str = setting(
        "", "A:B: cudaProfilerStart after A timed steps of run 1, Stop after B (nsys capture range)", group="output"
    )
    # runs and reporting
    runs: int = setting(1, "independent runs in one process (1..1000), seeds seed, seed+1, ...", group="basic")
    seed: int = setting(0, "seed of the first run", group="basic")
    target_acc: float = setting(94.0, "test accuracy (%, 0..100) a run must reach to count as reached", group="output")
    out_dir: str = setting("runs", "each invocation writes its logs to a new folder in here", group="basic")
    quiet: bool = setting(
        False, "no progress bars (they show only on rank 0 and only when stderr is a terminal)", group="output"
    )
    tensorboard: bool = setting(
        False,
        "TensorBoard event files in the run folder's tensorboard/ (per epoch: loss, accuracy, rates, step time; the "
        "settings); needs pip install tensorboard",
        group="output",
    )
    # checkpoints (fastcifar.checkpoint)
    save_model: bool = setting(
        True,
        "write the final, evaluated weights to the run folder (model.safetensors), off the clock",
        group="checkpoints",
    )
    checkpoint_every: int = setting(
        0, "epochs between training-state checkpoints (run folder's checkpoint.pt); 0 = none", group="checkpoints"
    )
    resume: str = setting(
        "",
        "training-state checkpoint (checkpoint.pt) to continue from, with its settings (options given must agree); "
        '"" = start fresh',
        group="checkpoints",
    )
    # controlled experiments (docs/experiments.md)
    save_outputs: str = setting(
        "none",
        "per-example outputs, .npy files in the run folder's outputs/ (outputs-run<N>/ with --runs N): test = the "
        "test set's logits (fp16) as the reported accuracy counts them, TTA included, and margins (fp32); train = "
        "plain-view logits and margins of every training image of the data set, in its order; both; none",
        group="experiments",
    )
    deterministic: bool = setting(
        False,
        "two runs with the same seed end with the same weights, bit for bit (same device model, rank count and "
        "versions): cuDNN's deterministic algorithms without the benchmark search, torch's deterministic kernels, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 when unset; a start-up line names what stays outside",
        group="experiments",
    )
    # the test harness's switches (scripts/gpu_visit.sh nccl2, tests/distributed/test_same_data.py): flags that
    # --help leaves out, never for training
    rank0_data: int = setting(
        0,
        "every rank trains on the data that rank 0 of N ranks trains on (its shard, shuffle and draws, batch / N "
        "images a step): the ranks' gradients are then equal and their average each one's bit for bit, so a run on "
        "N ranks must equal one process given the same N; 0 = off",
        group="testing",
    )
    share_gpu: bool = setting(
        False,
        "several ranks of a node may share its GPUs: local rank r on GPU r mod (the GPU count); a real run gives "
        "each rank its own GPU (scripts/rank_env.sh: the multi-rank NCCL path on one GPU)",
        group="testing",
    )
    # controlled experiments (fastcifar.core.streams, fastcifar.data.subsets)
    seed_init: int = setting(
        -1, "seed of the initial weights; -1 = derived from --seed (run k: this + k - 1)", group="experiments"
    )
    seed_order: int = setting(
        -1,
        "seed of each epoch's image order, drawn over the whole training set and then filtered to the subset; -1 = "
        "derived from --seed",
        group="experiments",
    )
    seed_aug: int = setting(
        -1,
        "seed of the crops, flips, cutouts and jitter, per image (data-set index) and epoch; -1 = derived from --seed",
        group="experiments",
    )
    seed_subset: int = setting(
        -1, "seed of --subset-fraction's draw; -1 = derived from --seed (run 1's)", group="experiments"
    )
    subset_mask: str = setting(
        "",
        "the training images to use: a .npy of booleans (one per training image) or of indices; the test set stays "
        'whole; "" = all',
        group="experiments",
    )
    subset_fraction: float = setting(
        0.0,
        "share of the training images to use, in (0, 1], drawn from --seed-subset; the test set stays whole; 0 = all",
        group="experiments",
    )
    steps: int = setting(
        0,
        "optimizer steps of a run, whatever the subset's size: --epochs becomes steps / steps-per-epoch (the warm-up "
        "keeps its share); 0 = from --epochs",
        group="experiments",
    )
    # set by --preset (or the config file, the checkpoint); not a flag of its own
    preset: str = setting("resnet9", "the preset this started from", group=None)


def flag_name(name: str) -> str:
    """A field's option without its dashes: ``warmup_epochs`` -> ``warmup-epochs``."""
    return name.replace("_", "-")


def parse_window(spec: str) -> tuple[int, int] | None:
    """'A:B' -> (A, B) with 0 <= A < B; '' -> None. ValueError otherwise."""
    if not spec:
        return None
    try:
        start, stop = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"expected A:B (two step counts), got {spec!r}") from None
    if not 0 <= start < stop:
        raise ValueError(f"expected 0 <= A < B, got {spec!r}")
    return start, stop


# Fields that leave the training trajectory alone: where things are, what is logged. A resumed run
# may change them (run.state refuses a checkpoint written under any other difference), and a run's
# config hash (run.report.provenance) leaves them out.
TRAJECTORY_FREE_FIELDS = (
    "data",
    "download",
    "download_set",
    "cache_dir",
    "out_dir",
    "resume",
    "checkpoint_every",
    "save_model",
    "nvtx",
    "profile_steps",
    "dist_timeout_s",
    "target_acc",
    "eval_batch_size",
    "quiet",
    "tensorboard",
    "share_gpu",
    "save_outputs",
)


def training_settings(cfg: Config) -> dict:
    """The fields that shape the training trajectory, as plain data."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in TRAJECTORY_FREE_FIELDS}


CHOICES = {
    "loader": ("auto", "dali", "torch"),
    "arch": ("resnet9", "fastnet", "alexnet"),
    "pad_mode": ("reflect", "zero"),
    "flip_mode": ("random", "alternate"),  # fastcifar.ops.augment.FLIP_MODES reads it
    "tta": (0, 1, 2),  # fastcifar.ops.tta.TTA_LEVELS reads it
    "whiten_kernel": (2, 3),
    "activation": ("relu", "gelu", "celu", "silu"),  # fastcifar.ops.norm_act_pool.ACTIVATIONS reads it
    "device": ("auto", "cuda", "cpu"),
    "precision": ("auto", "fp16", "fp32"),
    "comm": ("bucketed", "ddp"),
    "cuda_graphs": ("auto", "on", "off"),
    "dist_group": ("auto", "always"),
    "kernels": ("auto", "triton", "torch"),  # fastcifar.models.blocks.KERNELS reads this one
    # fastcifar.parallel.compress reads these three: one source, no copy to keep in step
    "compress": ("none", "fp16", "bf16", "topk", "randomk", "threshold", "terngrad", "qsgd", "powersgd"),
    "compress_scope": ("layer", "bucket", "model"),
    "compress_transport": ("sparse", "dense"),
    "sparse_mask": ("none", "fisher", "random"),
    "mask_score": ("squared", "abs", "expected"),
    "sparse_update": ("full", "grad"),
    "merge": ("mean", "sum"),
    "mask_layout": ("shared", "disjoint"),
    "local_momentum": ("keep", "reset"),
    "download_set": ("cifar10", "cifar100"),
    "lr_at": ("end", "start"),
    "lookahead_epoch_end": ("fold", "reset"),
    "optimizer": ("sgd", "muon"),
    "save_outputs": ("none", "test", "train", "both"),  # fastcifar.run.outputs reads it
    "tta_scope": ("batch", "test"),  # fastcifar.ops.tta.TTA_SCOPES reads it
    "newton_schulz": ("loop", "stacked"),  # fastcifar.run.optim.NEWTON_SCHULZ reads it
}

# Every numeric field's range, in one place: field -> (low, high, brackets). None is unbounded on
# that side; brackets say which ends are included: "[]", "[)", "(]" or "()". validate() checks
# them all before any work and names the option, its value and the range. The upper bounds of the
# settings that size memory or time (epochs, runs, widths, batches, warm-up steps, ...) are far
# above any recipe's, and low enough that nothing is allocated or scheduled for hours before a
# step (``--epochs 1e9`` would build a schedule list of 1e9 x steps entries). Ranges that depend on
# another field (--warmup-epochs, --crop-pad's upper end) and --seed (0..2^63-1-runs) are
# checked after these.
MAX_EPOCHS = 1000
MAX_RUNS = 1000
MAX_WIDTH = 4096  # channels of one layer
MAX_BATCH = 65536  # images per step (training, global) or per evaluation batch (per rank)
MAX_STEPS = 10**6  # training steps of a run (epochs x steps per epoch; the trainer checks, it knows the data)
RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "rank0_data": (0, 1024, "[]"),  # a rank count, as --emulate-ranks
    "subset": (0, None, "[)"),
    "val_split": (0, None, "[)"),
    "whiten_eps": (0, None, "()"),
    "whiten_images": (0, None, "[)"),
    "whiten_bias_epochs": (0, None, "[)"),
    "bn_momentum": (0, 1, "(]"),
    "epochs": (0, MAX_EPOCHS, "(]"),
    "batch_size": (1, MAX_BATCH, "[]"),
    "lr": (0, None, "[)"),
    "warmup_epochs": (0, None, "[)"),  # and at most --epochs (validate)
    "lr_start": (0, None, "[)"),
    "lr_end": (0, None, "[)"),
    "bias_lr_scale": (0, None, "()"),
    "momentum": (0, 1, "[)"),
    "weight_decay": (0, None, "[)"),
    "label_smoothing": (0, 1, "[)"),
    "tta_share": (0, 1, "(]"),
    "lookahead_steps": (0, None, "[)"),
    "lookahead_decay": (0, 1, "[)"),
    "crop_pad": (0, None, "[)"),  # and below the image side (validate: it depends on --pad-mode)
    "cutout": (0, 32, "[]"),  # IMAGE_SIDE
    "brightness": (0, 10, "[]"),  # stds: 10 shifts any pixel far past the data set's range
    "contrast": (0, 1, "[)"),  # a scale stays positive: 1 would allow an image scaled to 0
    "bn_eps": (0, 1, "()"),
    "lookahead_start_epoch": (0, None, "[)"),
    "muon_lr": (0, None, "[)"),
    "muon_momentum": (0, 1, "[)"),
    "muon_ns_steps": (1, 100, "[]"),
    "head_lr_scale": (0, None, "()"),
    "logit_scale": (0, None, "[)"),
    "sparse_fraction": (0, 1, "(]"),
    "mask_samples": (1, 10**6, "[]"),
    "mask_every": (0, None, "[)"),
    "local_steps": (0, None, "[)"),
    "bucket_mb": (0, 1024, "(]"),
    "eval_batch_size": (1, MAX_BATCH, "[]"),
    "warmup_steps": (0, 1000, "[]"),
    "dist_timeout_s": (0, 10**6, "(]"),  # seconds; datetime.timedelta overflows far above
    "emulate_ranks": (1, 1024, "[]"),  # the batch must divide over them (validate)
    "compress_ratio": (0, 1, "(]"),
    "compress_threshold": (0, None, "[)"),
    "qsgd_levels": (1, 32767, "[]"),  # int8 on the wire up to 127, int16 beyond
    "powersgd_rank": (1, MAX_WIDTH, "[]"),
    "compress_warmup_steps": (0, None, "[)"),
    "runs": (1, MAX_RUNS, "[]"),
    "target_acc": (0, 100, "[]"),
    "checkpoint_every": (0, None, "[)"),
    "subset_fraction": (0, 1, "[]"),  # 0 = off
    "steps": (0, MAX_STEPS, "[]"),  # 0 = from --epochs
}
WIDTH_RANGE = (1, MAX_WIDTH, "[]")  # each of --widths


def _range_text(low, high, brackets: str, integer: bool) -> str:
    """'positive', 'at least 1', '1..1000', '[0, 1)': the words for one RANGES entry."""
    if high is None:
        if low == 0:
            return "positive" if brackets[0] == "(" else "not negative"
        return f"at least {low}" if brackets[0] == "[" else f"greater than {low}"
    if integer and brackets == "[]":
        return f"{low}..{high}"
    return f"{brackets[0]}{low}, {high}{brackets[1]}"


def _in_range(value, low, high, brackets: str) -> bool:
    above = low is None or (value >= low if brackets[0] == "[" else value > low)
    below = high is None or (value <= high if brackets[1] == "]" else value < high)
    return above and below


def _range_error(name: str, value, low, high, brackets: str) -> ConfigError:
    integer = isinstance(value, int) and all(isinstance(b, int) for b in (low, high) if b is not None)
    text = _range_text(low, high, brackets, integer)
    phrase = {"positive": "must be positive", "not negative": "must not be negative"}.get(
        text, f"must be {text}" if high is None else f"must lie in {text}"
    )
    return ConfigError(f"--{flag_name(name)} {phrase}, not {value}")


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is an int to Python


# A field's annotation (a string here: __future__) -> whether a value has that type, and the words
# for it. Shared by a Config's check (``_check_types``) and a config file's (``_typed``).
_FIELD_TYPES = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (_whole, "a whole number"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple": (lambda v: isinstance(v, (tuple, list)) and all(map(_whole, v)), "a list of whole numbers"),
}


def _field_type(name: str, annotation: str):
    """``_FIELD_TYPES``' entry for ``annotation`` ("tuple[int, ...]" is "tuple")."""
    try:
        return _FIELD_TYPES[annotation.split("[")[0]]
    except KeyError:
        raise AssertionError(f"Config.{name}: no type check for {annotation!r}") from None  # a new field's type


def _check_types(cfg: Config) -> None:
    """Each field holds its default's type (an API Config, a model file's metadata): a string
    where a number belongs would otherwise fail later with a traceback."""
    for f in fields(Config):
        value = getattr(cfg, f.name)
        ok, what = _field_type(f.name, str(f.type))
        if not ok(value):
            raise ConfigError(f"--{flag_name(f.name)} must be {what}, not {value!r}")


def from_preset(name: str = DEFAULT_PRESET, **overrides) -> Config:
    """The preset's config with ``overrides``; like the command line, a changed ``epochs`` without
    a ``warmup_epochs`` keeps the peak at the same fraction of the run."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return with_overrides(dataclasses.replace(Config(), preset=name, **PRESETS[name]), overrides)


def with_overrides(base: Config, overrides: dict) -> Config:
    """``base`` with ``overrides``; a changed ``epochs`` without a ``warmup_epochs`` scales base's
    warm-up with it, so the peak stays at the same fraction of the run (a preset's, a config file's)."""
    if "epochs" in overrides and "warmup_epochs" not in overrides and overrides["epochs"] != base.epochs:
        overrides = {**overrides, "warmup_epochs": base.warmup_epochs * overrides["epochs"] / base.epochs}
    return dataclasses.replace(base, **overrides)


SEED_MAX = 2**63 - 1  # torch.manual_seed and numpy's SeedSequence both take seeds in 0..2^63-1 here
IMAGE_SIDE = 32  # pixels: the CIFAR-10 image the crop and cutout are measured against


def check_fields(cfg: Config) -> Config:
    """Each field on its own: its type, a finite number, one of its CHOICES, within its RANGES
    (every width too) and the widths' count for the architecture. ``validate`` starts here; a model
    file's metadata is checked with this before anything is built from it."""
    _check_types(cfg)
    for f in fields(Config):  # nan passes every comparison below, inf most: refuse both first
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{flag_name(f.name)} must be a finite number, not {value}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"--{flag_name(name)} must be one of {', '.join(map(str, allowed))}, not {getattr(cfg, name)!r}"
            )
    for name, (low, high, brackets) in RANGES.items():
        if not _in_range(getattr(cfg, name), low, high, brackets):
            raise _range_error(name, getattr(cfg, name), low, high, brackets)
    n_widths = {"resnet9": 4, "fastnet": 3, "alexnet": 5}[cfg.arch]
    if len(cfg.widths) != n_widths or min(cfg.widths) <= 0:
        raise ConfigError(
            f"--widths takes {('three', 'four', 'five')[n_widths - 3]} positive channel counts for "
            f"--arch {cfg.arch}, not {tuple(cfg.widths)}"
        )
    for width in cfg.widths:
        if not _in_range(width, *WIDTH_RANGE):
            raise ConfigError(
                f"--widths: each must lie in {_range_text(*WIDTH_RANGE, True)} channels, "
                f"not {width} (in {tuple(cfg.widths)})"
            )
    return cfg


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Reject settings that cannot work, with one sentence naming the field."""
    check_fields(cfg)
    world_size = _validate_emulated(cfg, world_size)  # below, the emulated ranks count as ranks
    if cfg.fused_conv and (cfg.compile or cfg.emulate_ranks > 1 or cfg.kernels == "torch"):
        raise ConfigError(
            "--fused-conv runs the Triton conv + normalize kernels in eager mode on one batch's "
            "statistics: it does not combine with --compile, --emulate-ranks or --kernels torch"
        )
    if not 0 <= cfg.warmup_epochs <= cfg.epochs:
        raise ConfigError(f"--warmup-epochs must lie in 0..{cfg.epochs} (the epochs), not {cfg.warmup_epochs}")
    if not 0 <= cfg.seed <= SEED_MAX - cfg.runs:  # run r uses seed + r - 1; bench's warm-up run seed + runs
        raise ConfigError(f"--seed must lie in 0..2^63-1-runs ({SEED_MAX - cfg.runs}), not {cfg.seed}")
    for name in STREAMS:  # run k uses the given seed + k - 1, as --seed
        value = getattr(cfg, f"seed_{name}")
        if value != UNSET and not 0 <= value <= SEED_MAX - cfg.runs:
            raise ConfigError(
                f"--seed-{name} must be -1 (derived from --seed) or lie in 0..2^63-1-runs ({SEED_MAX - cfg.runs}), "
                f"not {value}"
            )
    subsets = [f"--{flag_name(n)}" for n in ("subset", "subset_mask", "subset_fraction") if getattr(cfg, n)]
    if len(subsets) > 1:
        raise ConfigError(f"{' and '.join(subsets)} each choose the training subset: give one of them")
    if 0 < cfg.val_split < world_size:  # each rank evaluates every world_size-th held-out image
        raise ConfigError(f"--val-split must be 0 or at least the number of ranks ({world_size}), not {cfg.val_split}")
    max_pad = IMAGE_SIDE - 1 if cfg.pad_mode == "reflect" else IMAGE_SIDE  # reflection needs pad < side
    if cfg.crop_pad > max_pad:
        raise ConfigError(
            f"--crop-pad must be at most {max_pad} with --pad-mode {cfg.pad_mode} "
            f"(the image side is {IMAGE_SIDE}), not {cfg.crop_pad}"
        )
    if cfg.activation != "gelu" and cfg.arch != "fastnet":
        raise ConfigError(f"--activation applies to --arch fastnet only ({cfg.arch} uses ReLU), not {cfg.activation!r}")
    if cfg.optimizer == "muon" and cfg.lr == 0:  # Muon's rate is --muon-lr x (the scheduled rate / the peak)
        raise ConfigError("--optimizer muon needs a positive --lr (Muon's rate follows --lr's schedule), not 0")
    _validate_compress(cfg)
    _validate_sparse(cfg, world_size)
    try:
        parse_window(cfg.profile_steps)
    except ValueError as exc:
        raise ConfigError(f"--profile-steps: {exc}") from None
    if (cfg.checkpoint_every or cfg.resume) and cfg.runs != 1:
        raise ConfigError(f"--checkpoint-every and --resume hold one run; use --runs 1, not {cfg.runs}")
    if (cfg.checkpoint_every or cfg.resume) and (
        cfg.compress != "none" or cfg.sparse_mask != "none" or cfg.local_steps
    ):
        # their state (error-feedback residuals, masks, local-SGD anchors) is not in the checkpoint
        raise ConfigError(
            "--checkpoint-every and --resume do not yet hold --compress, --sparse-mask or "
            "--local-steps state; use one or the other"
        )
    if cfg.optimizer == "muon" and (cfg.sparse_mask != "none" or cfg.local_steps):
        # the default preset trains with Muon: say where it came from and what to run instead
        from_muon_preset = PRESETS.get(cfg.preset, {}).get("optimizer") == "muon"  # an API Config may name none
        source = f"preset {cfg.preset} trains with --optimizer muon" if from_muon_preset else "--optimizer muon"
        raise ConfigError(
            f"{source}, which does not combine with --sparse-mask or --local-steps (their "
            f"masked update and local merges wrap Nesterov SGD); use an SGD preset, e.g. --preset resnet9"
        )
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not divide over {world_size} ranks "
            f"(the per-rank batch must be a whole number)"
        )
    if cfg.rank0_data and (cfg.batch_size % cfg.rank0_data or cfg.emulate_ranks > 1):
        raise ConfigError(
            f"--rank0-data {cfg.rank0_data} takes rank 0's batch of {cfg.batch_size} / {cfg.rank0_data} images: "
            "the batch must divide over it, without --emulate-ranks"
        )
    return cfg


def _validate_emulated(cfg: Config, world_size: int) -> int:
    """``--emulate-ranks N``: one process, and only what it emulates (the shards, the batchnorm
    statistics per rank, the plain average of gradients); the number of ranks the rest of
    ``validate`` checks the settings against (N: the batch must divide over them as over N ranks)."""
    if cfg.emulate_ranks == 1:
        return world_size
    if world_size > 1:
        raise ConfigError(
            f"--emulate-ranks {cfg.emulate_ranks} emulates ranks in one process, but this run has "
            f"{world_size} real ranks (torchrun): use one or the other"
        )
    if cfg.compress != "none" or cfg.sparse_mask != "none" or cfg.local_steps:
        raise ConfigError(
            f"--emulate-ranks {cfg.emulate_ranks} emulates the plain average of gradients; it does "
            f"not combine with --compress, --sparse-mask or --local-steps"
        )
    return cfg.emulate_ranks


def _validate_compress(cfg: Config) -> None:
    if cfg.compress == "none":
        return
    if cfg.comm != "bucketed":
        raise ConfigError(f"--compress {cfg.compress} needs --comm bucketed (it runs inside its buckets)")
    if cfg.compress == "powersgd" and cfg.compress_transport == "dense":
        raise ConfigError("--compress powersgd has no --compress-transport dense (its two all-reduces are the method)")


def _validate_sparse(cfg: Config, world_size: int) -> None:
    if cfg.sparse_checkpoints and cfg.sparse_mask == "none":
        raise ConfigError("--sparse-checkpoints needs --sparse-mask fisher or random (a dense run's diffs are dense)")
    if cfg.local_steps and cfg.compress != "none":
        raise ConfigError(
            f"--compress {cfg.compress} needs --local-steps 0 (local SGD merges weights, "
            "it has no gradient all-reduce to compress)"
        )
    if cfg.local_steps and cfg.lookahead_steps:
        raise ConfigError(
            "--local-steps needs --lookahead-steps 0 (each rank's slow copy would drift from the merged weights)"
        )
    if cfg.mask_layout == "disjoint":
        if not cfg.local_steps or cfg.sparse_mask == "none":
            raise ConfigError("--mask-layout disjoint needs --local-steps and --sparse-mask fisher or random")
        if world_size * cfg.sparse_fraction > 1:
            raise ConfigError(
                f"--mask-layout disjoint deals {world_size} x --sparse-fraction "
                f"{cfg.sparse_fraction} of the parameters: more than all of them"
            )


def full_recipe(cfg: Config) -> bool:
    """Whether a run is its preset's full recipe on the full data, where the --target-acc bar
    (94%, set for the full recipes on CIFAR-10) means something: no --subset or --val-split, the
    preset's network at no narrower widths, and no fewer epochs. A toy run (a CPU smoke test, a
    sweep's shortened point) gets no "missed" verdict."""
    if cfg.preset not in PRESETS:
        return False
    base = from_preset(cfg.preset)
    return (
        cfg.subset == 0
        and not cfg.subset_mask
        and cfg.subset_fraction == 0
        and cfg.steps == 0
        and cfg.val_split == 0
        and cfg.arch == base.arch
        and cfg.epochs >= base.epochs
        and len(cfg.widths) == len(base.widths)
        and all(w >= b for w, b in zip(cfg.widths, base.widths, strict=True))
    )


CONFIG_FILE = "config.json"  # every run folder's settings (run.report writes it); `--config FILE` reads one back


def config_file_text(cfg: Config) -> str:
    """What a run folder's config.json holds: every setting, as JSON."""
    return json.dumps(dataclasses.asdict(cfg), indent=2) + "\n"


def _typed(where: str, name: str, annotation: str, value):
    """``value`` of the JSON file as the field's type (a list as a tuple), or ConfigError."""
    ok, _ = _field_type(name, annotation)
    if not ok(value):
        raise ConfigError(f"{where}: {name} must be {annotation.split('[')[0]}, not {json.dumps(value)}")
    return tuple(value) if isinstance(value, list) else value


MAX_CONFIG_BYTES = 1 << 20  # a run folder's config.json is about 3 KB; a larger file is not one


def read_config_file(path: str) -> Config:
    """The settings of a run folder's config.json (``--config FILE``), or ConfigError in one line: a
    file that cannot be read, is not JSON, or holds an unknown setting or a value of the wrong type.
    A setting it lacks (added since it was written) is its preset's; ``resume`` is not read back
    (the repeated run starts fresh, as ``--resume`` given beside it says otherwise)."""
    from fastcifar.core.readfile import read_regular, why

    where = f"--config {path}"
    try:
        doc = json.loads(read_regular(path, max_bytes=MAX_CONFIG_BYTES))
    except OSError as exc:
        raise ConfigError(f"{where}: {why(exc)}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{where}: not a JSON file of settings ({exc})") from None
    except RecursionError:  # arrays or objects nested thousands deep: json's parser recurses
        raise ConfigError(f"{where}: not a JSON file of settings (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a JSON object of settings (a run folder's {CONFIG_FILE})")
    known = {f.name: f for f in fields(Config)}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown setting {unknown[0]!r} (the settings are the options' names, as in --help)"
        )
    preset = doc.get("preset", DEFAULT_PRESET)
    if not isinstance(preset, str):  # a list or an object cannot be looked up (unhashable)
        names = {list: "an array", dict: "an object", bool: "true or false", type(None): "null"}
        what = names.get(type(preset), "a number")
        raise ConfigError(f"{where}: preset must be a preset's name (a string), not {what}")
    if preset not in PRESETS:
        raise ConfigError(f"{where}: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    values = {k: _typed(where, k, str(known[k].type), v) for k, v in doc.items() if k != "resume"}
    return dataclasses.replace(from_preset(preset), **values)


def check_run_length(cfg: Config, steps_per_epoch: int, images: int, world_size: int) -> None:
    """Once the data fixes the steps per epoch: refuse a batch larger than the training set, and a
    run of more than MAX_STEPS steps in all (the schedule holds one rate per step). One line,
    before the run folder is made."""
    if steps_per_epoch == 0:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is larger than the training set "
            f"({images} images over {world_size} rank{'s' if world_size > 1 else ''})"
        )
    total = math.ceil(cfg.epochs * steps_per_epoch)
    if total > MAX_STEPS:
        raise ConfigError(
            f"--epochs {cfg.epochs} x {steps_per_epoch} steps per epoch (--batch-size {cfg.batch_size}) is "
            f"{total} steps, more than {MAX_STEPS}: fewer epochs or a larger batch"
        )


def in_steps(cfg: Config, steps_per_epoch: int) -> Config:
    """``--steps N``, once the data fixes the steps per epoch: ``epochs`` becomes N / steps-per-epoch
    (a fraction cuts the last epoch short) and the warm-up keeps its share of the run, so a subset
    of any size trains for N optimizer steps. Without ``--steps`` (or once done) ``cfg`` itself."""
    if not cfg.steps or steps_per_epoch == 0:
        return cfg
    epochs = cfg.steps / steps_per_epoch
    if epochs == cfg.epochs:  # a resumed run's settings are in steps already
        return cfg
    if epochs > MAX_EPOCHS:
        raise ConfigError(
            f"--steps {cfg.steps} is {epochs:g} epochs of {steps_per_epoch} steps, more than {MAX_EPOCHS}: "
            f"fewer steps, or a smaller batch"
        )
    return dataclasses.replace(cfg, epochs=epochs, warmup_epochs=cfg.warmup_epochs * epochs / cfg.epochs)


def schedule_line(cfg: Config, steps_per_epoch: int) -> tuple[str, dict]:
    """The run's schedule in steps and epochs: a line for the log and the summary's entry."""
    total = math.ceil(round(cfg.epochs * steps_per_epoch, 9))  # run.schedule.epoch_lengths' count
    given = "steps" if cfg.steps else "epochs"
    doc = {"steps": total, "epochs": cfg.epochs, "steps_per_epoch": steps_per_epoch, "given_in": given}
    return f"schedule: {total} steps = {cfg.epochs:g} epochs of {steps_per_epoch} steps", doc
