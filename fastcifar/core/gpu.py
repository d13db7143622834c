"""What this machine's NVIDIA GPU can run, asked before any CUDA work, and the choices
that follow from its compute capability.

The preflight (``cuda_or_cpu``, then ``before_cuda_work``) runs wherever a GPU is taken: in
``parallel.distributed.pick_device`` (the trainer) and ``models.files.network_from_weights``
(evaluate, predict, the API), both through ``before_cuda_work``. It turns the failures a user would
otherwise meet as a traceback at the first kernel launch into one line that names the GPU, its
capability, the installed torch and the install line of README's Install table that fixes it:

* torch built for none of the device's architectures: a pip torch for CUDA 13 (2.11 and newer) is
  built for sm_75 ... sm_120, so on a V100 (7.0) its first kernel raises "no kernel image is
  available";
* CUDA unavailable although ``nvidia-smi`` lists a GPU: usually a driver older than this torch's
  CUDA needs; ``--device auto`` would train on the CPU without saying why;
* ``--loader dali`` with a DALI build that holds no code for the device (CUDA 13 builds start at
  sm_75), or two DALI builds installed side by side (they write the same files);
* ``--compress bf16`` below capability 8.0, where bf16 has no tensor-core arithmetic.

The dtype policy: Muon's Newton-Schulz iteration in bf16 from capability 8.0 (Ampere: bf16 tensor
cores), in fp16 below (``newton_schulz_dtype``; ``run.optim.newton_schulz`` scales to unit norm
before that cast, fp16's range ending at 65504). Hopper and Ampere keep every choice they had.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re
import shutil
import subprocess

import torch

from fastcifar.core.environment import place_triton_cache
from fastcifar.core.errors import ConfigError

# README's Install table, one line per GPU generation: (lowest capability, generation, command).
# A generation's line is the last whose capability the device reaches.
INSTALLS = (
    ((7, 0), "Volta (V100)", "pip install -e '.[volta]'"),
    ((7, 5), "Turing and newer", "pip install -e '.[dali]'"),
)
# The lowest capability each CUDA major's DALI build runs on. CUDA 13 dropped Maxwell, Pascal and
# Volta (CUDA 13.0 release notes); nvidia-dali-cuda130 2.4.0 holds no sm_70 code and
# nvidia-dali-cuda120 2.4.0 does (cuobjdump --list-elf).
DALI_MIN_CAPABILITY = {13: (7, 5), 12: (7, 0)}
BF16_CAPABILITY = (8, 0)  # Ampere: the first tensor cores that multiply bf16
NVIDIA_SMI_TIMEOUT_S = 10.0  # nvidia-smi -L answers in well under a second; a hung driver must not hang the start
# The SM count a launch grid assumes where there is no GPU to ask (the interpreter, the CPU compile
# of bench/kernel_registers.py): an H100's, the count the fused conv's grid was tuned at.
DEFAULT_SMS = 132


def parse_arch(entry: str) -> tuple[str, int, int, str] | None:
    """("sm" or "compute", major, minor, suffix) of an entry of torch's arch list: sm_90 -> ("sm", 9,
    0, ""), compute_120 -> ("compute", 12, 0, ""), sm_90a -> ("sm", 9, 0, "a"); None if unreadable."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", entry.strip())
    if not m:
        return None
    number = int(m.group(2))
    return m.group(1), number // 10, number % 10, m.group(3)


def runs_on(entry: str, capability: tuple[int, int]) -> bool:
    """Whether code built as ``entry`` (sm_XY: a cubin; compute_XY: PTX) runs on a device of
    ``capability``. A cubin runs on its own major at its minor or above (sm_80 on an 8.6); one built
    for an arch-specific target (sm_90a) only on that exact capability; PTX is compiled by the
    driver for any capability at or above its own."""
    parsed = parse_arch(entry)
    if parsed is None:
        return False
    kind, major, minor, suffix = parsed
    if suffix == "a":
        return (major, minor) == tuple(capability)
    if kind == "compute":
        return (major, minor) <= tuple(capability) if not suffix else major == capability[0] and minor <= capability[1]
    return major == capability[0] and minor <= capability[1]


def arch_list() -> list[str]:
    """torch's arch list (``torch.cuda.get_arch_list()``: sm_75, sm_80, ..., maybe compute_XY); empty
    under a ROCm build, whose gfx names say nothing about NVIDIA compute capabilities (no check then)."""
    if torch.version.hip:
        return []
    return list(torch.cuda.get_arch_list())


def install_line(capability: tuple[int, int]) -> tuple[str, str] | None:
    """(generation, install command) of README's Install table for ``capability``; None below Volta."""
    fits = [(gen, cmd) for lowest, gen, cmd in INSTALLS if tuple(capability) >= lowest]
    return fits[-1] if fits else None


def _fix(capability: tuple[int, int]) -> str:
    line = install_line(capability)
    if line is None:
        return "README's install lines cover compute capability 7.0 (Volta) and newer; use --device cpu"
    return f"install the {line[0]} line of README's Install table: {line[1]}"


def _torch_build() -> str:
    return f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else "")


def describe(index: int) -> tuple[str, tuple[int, int]]:
    """("GPU 0 (Tesla V100-SXM2-16GB, compute capability 7.0)", (7, 0))."""
    capability = _cuda_capability(index)
    name = torch.cuda.get_device_name(index)
    return f"GPU {index} ({name}, compute capability {capability[0]}.{capability[1]})", capability


def driver_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists ("GPU 0: Tesla V100-SXM2-16GB"), [] without nvidia-smi or
    when it fails or does not answer within ``timeout_s``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [
        re.sub(r"\s*\(UUID:[^)]*\)", "", line).strip() for line in out.stdout.splitlines() if line.startswith("GPU ")
    ]


def cuda_or_cpu(requested: str) -> tuple[bool, str | None]:
    """For --device ``requested`` (auto or cuda): (whether to use CUDA, a one-line notice for the
    CPU fallback). Raises ConfigError for --device cuda without CUDA. When torch sees no GPU but the
    driver's nvidia-smi lists one, the line says so (a driver too old for this torch's CUDA, or a
    CPU build of torch): the notice under auto, the error under cuda."""
    if torch.cuda.is_available():
        return True, None
    listed = driver_gpus()
    why = None
    if listed:
        more = f" and {len(listed) - 1} more" if len(listed) > 1 else ""
        cause = (
            "a CPU build"
            if not torch.version.cuda
            else f"built for CUDA {torch.version.cuda}: the driver is likely older than that CUDA needs"
        )
        why = (
            f"nvidia-smi lists {listed[0]}{more}, but {_torch_build()} cannot use it ({cause}); "
            "install the line for your GPU from README's Install table, or update the NVIDIA driver"
        )
    if requested == "cuda":
        raise ConfigError("--device cuda was asked for, but " + (why or "PyTorch sees no CUDA GPU"))
    return False, (f"note: {why}; training on the CPU" if why else None)


def preflight(index: int, loader: str = "auto", compress: str = "none") -> None:
    """Before any CUDA work on GPU ``index``: ConfigError (one line) if torch, the DALI build that
    ``--loader dali`` would use, or ``--compress bf16`` cannot run on it."""
    what, capability = describe(index)
    archs = arch_list()
    if archs and not any(runs_on(a, capability) for a in archs):
        raise ConfigError(
            f"{what} cannot run {_torch_build()}, which is built for {' '.join(archs)}: {_fix(capability)}"
        )
    if loader == "dali":
        builds = dali_builds()
        if len(builds) > 1:
            raise ConfigError(
                f"--loader dali: {len(builds)} DALI builds are installed ({', '.join(n for n, _ in builds)}), "
                "which write the same files: uninstall all but the one README's Install table gives for your GPU"
            )
        if builds and builds[0][1] in DALI_MIN_CAPABILITY and capability < DALI_MIN_CAPABILITY[builds[0][1]]:
            low = DALI_MIN_CAPABILITY[builds[0][1]]
            raise ConfigError(
                f"--loader dali: {what} cannot run {builds[0][0]} (CUDA {builds[0][1]}: compute capability "
                f"{low[0]}.{low[1]} and newer): {_fix(capability)}, or use --loader torch"
            )
    if compress == "bf16" and capability < BF16_CAPABILITY:
        raise ConfigError(
            f"--compress bf16: {what} has no bf16 arithmetic (it arrives with capability 8.0); use --compress fp16"
        )


def before_cuda_work(index: int, loader: str = "auto", compress: str = "none") -> str:
    """The one step every path to GPU ``index`` takes before any CUDA work: the ``preflight``
    (ConfigError, one line), then Triton's kernel cache kept off a HOME that does not exist
    (``environment.place_triton_cache``: the fused kernels compile on any CUDA device). Returns
    that note, or "": the caller says it where its other notes go."""
    preflight(index, loader, compress)
    return place_triton_cache("cuda")


def dali_builds() -> list[tuple[str, int]]:
    """The installed DALI distributions and the CUDA major each is built for:
    [("nvidia-dali-cuda130", 13)]; read from the package metadata, DALI is not imported."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        m = re.fullmatch(r"nvidia-dali-cuda(\d+)0", name)
        if m:
            found.add((name, int(m.group(1))))
    return sorted(found)


# --- choices by capability ------------------------------------------------------------------------

_stand_in: list[tuple[int, int]] = []  # the target capability while bench/kernel_registers.py records launches


@contextlib.contextmanager
def standing_in(capability: tuple[int, int]):
    """Inside, ``capability`` of a CPU device answers ``capability``: the compile sweep records the
    launches a GPU of that capability would make (``bench/aot.py``'s ``recording``)."""
    _stand_in.append(tuple(capability))
    try:
        yield
    finally:
        _stand_in.pop()


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``; for another device the one ``standing_in`` gives, or None."""
    if device.type == "cuda":
        return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
    return _stand_in[-1] if _stand_in else None


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    # asked once per device: the fused conv's launcher reads it on every eager forward
    return tuple(torch.cuda.get_device_capability(index))


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """Muon's Newton-Schulz precision: bf16 where the GPU multiplies bf16 on tensor cores (8.0 and
    newer); fp16 below, which tests/unit/test_gpu.py shows closer to the fp32 iteration than
    bf16 once the norm scaling comes before the cast; fp32 on the CPU (bf16 matmuls are slow there
    and the tests compare ranks at fp32)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if capability(device) >= BF16_CAPABILITY else torch.float16


@functools.cache
def _cuda_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (asked once per device), else ``DEFAULT_SMS``."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
