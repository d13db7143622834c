"""A study's spec: the base preset and settings, the axes whose product gives the arms, runs per arm,
the subset policy, the outputs to keep and the base seed; read from TOML or JSON and checked whole,
each arm's Config by Config's own validation, before any work.

    preset = "fast"            # optional: the default preset
    seed = 0                   # run i of every arm has the run seed seed + i (paired designs)
    runs = 64                  # per arm
    keep = ["test_margins", "test_logits", "train_margins", "model"]   # any of these; default test_margins
    [settings]                 # any Config field but those the sweep sets (SWEEP_OWNED)
    data = "data"
    epochs = 1
    [axes]                     # optional; each a list of values, the arms their product
    lr = [0.2, 0.4]
    [subset]                   # optional; policy "all" (default) | "fraction" | "masks"
    policy = "fraction"
    fraction = 0.5             # each run's own draw from its subset stream (run i alike in every arm)
    # masks = "masks.npy"      # policy "masks": bool [>= runs, training images], row i for run i

TOML needs Python 3.11's tomllib (or the tomli package on 3.10); JSON of the same shape is read
everywhere.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.core.readfile import why

KEEP = ("test_margins", "test_logits", "train_margins", "model")
POLICIES = ("all", "fraction", "masks")
TOP_KEYS = ("preset", "seed", "runs", "keep", "settings", "axes", "subset")
# fields the sweep sets for each run: the seed and subset per run, the outputs from ``keep``, the
# device from --devices, the run folder inside the store
SWEEP_OWNED = {
    "seed": "the spec's top-level seed",
    "runs": "the spec's top-level runs (per arm)",
    "out_dir": "the store (each run's folder is in its runs/)",
    "save_outputs": "keep",
    "save_model": 'keep ("model")',
    "subset_mask": "[subset] policy",
    "subset_fraction": "[subset] policy",
    "seed_subset": "[subset] policy (each run's own draw)",
    "resume": "the sweep (a run starts over when its worker stops)",
    "device": "--devices",
    "quiet": "the sweep (one progress line for the study)",
}
MAX_RUNS = 1_000_000


@dataclass(frozen=True)
class Arm:
    index: int
    name: str  # "base" without axes, else "lr=0.2,label_smoothing=0.1"
    values: dict  # the axes' values of this arm


@dataclass
class Spec:
    preset: str
    seed: int
    runs: int  # per arm
    keep: tuple
    settings: dict
    axes: dict  # name -> list of values, in the spec's order
    policy: str
    fraction: float
    masks: str  # absolute path of the masks file ("" unless policy "masks")

    @property
    def arms(self) -> list[Arm]:
        names = list(self.axes)
        combos = itertools.product(*(self.axes[n] for n in names)) if names else [()]
        return [
            Arm(
                i,
                ",".join(f"{n}={_show(v)}" for n, v in zip(names, combo, strict=True)) or "base",
                dict(zip(names, combo, strict=True)),
            )
            for i, combo in enumerate(combos)
        ]

    def as_dict(self) -> dict:
        return {
            "preset": self.preset,
            "seed": self.seed,
            "runs": self.runs,
            "keep": list(self.keep),
            "settings": self.settings,
            "axes": self.axes,
            "subset": {"policy": self.policy, "fraction": self.fraction, "masks": self.masks},
        }

    def config(self, arm: Arm, rep: int, out_dir: str, device: str, mask_file: str = "") -> Config:
        """Run ``rep`` of ``arm``: the base settings and the arm's values, the run seed seed + rep,
        its subset, the outputs to keep, one run, quiet, in ``out_dir``."""
        test = "test_margins" in self.keep or "test_logits" in self.keep
        train = "train_margins" in self.keep
        overrides = {**self.settings, **arm.values}
        overrides.update(
            seed=self.seed + rep,
            runs=1,
            out_dir=out_dir,
            device=device,
            quiet=True,
            save_model="model" in self.keep,
            save_outputs={(True, True): "both", (True, False): "test", (False, True): "train"}.get(
                (test, train), "none"
            ),
        )
        if self.policy == "fraction":
            overrides["subset_fraction"] = self.fraction
        elif self.policy == "masks":
            overrides["subset_mask"] = mask_file
        return from_preset(self.preset, **overrides)


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def read_text(path: str) -> dict:
    """The spec file as plain data: TOML by its .toml suffix, JSON otherwise."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the spec {path}: {why(exc)}") from None
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ConfigError(
                    f"{path}: a TOML spec needs Python 3.11+ or `pip install tomli`; or write it as JSON"
                ) from None
        try:
            doc = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    else:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a spec is a table (TOML) or an object (JSON) of {', '.join(TOP_KEYS)}")
    return doc


def _plain(name: str, value):
    """A TOML/JSON value as the Config field holds it (lists -> tuples for widths and the like)."""
    return tuple(value) if isinstance(value, list) else value


def parse(doc: dict, where: str, base: Path) -> Spec:
    """Check ``doc`` whole and return the Spec; every arm's first run is validated as the trainer
    validates. ``base``: the folder a relative masks path is read from (the spec file's)."""
    unknown = sorted(set(doc) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a spec has {', '.join(TOP_KEYS)}")
    preset = doc.get("preset", DEFAULT_PRESET)
    seed, runs = doc.get("seed", 0), doc.get("runs")
    if runs is None:
        raise ConfigError(f"{where}: say how many runs per arm (runs = N)")
    for name, value, low, high in (("seed", seed, 0, 2**62), ("runs", runs, 1, MAX_RUNS)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{where}: {name} must be a whole number in {low}..{high}, not {value!r}")
    keep = doc.get("keep", ["test_margins"])
    if not isinstance(keep, list) or not all(k in KEEP for k in keep):
        raise ConfigError(f"{where}: keep is a list of {', '.join(KEEP)}, not {keep!r}")
    settings, axes, subset = (doc.get(k, {}) for k in ("settings", "axes", "subset"))
    for name, table in (("settings", settings), ("axes", axes), ("subset", subset)):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{name}] must be a table, not {table!r}")
    known = {f.name for f in fields(Config)}
    for name in [*settings, *axes]:
        if name in SWEEP_OWNED:
            raise ConfigError(f"{where}: {name} is set by the sweep, from {SWEEP_OWNED[name]}")
        if name not in known:
            raise ConfigError(f"{where}: unknown setting {name!r} (the settings are Config's fields: --help's flags)")
    for name, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: axis {name} must be a non-empty list of values, not {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise ConfigError(f"{where}: axis {name} names a value twice: {values!r}")
        if name in settings:
            raise ConfigError(f"{where}: {name} is both a setting and an axis")
    policy = subset.get("policy", "all")
    unknown = sorted(set(subset) - {"policy", "fraction", "masks"})
    if unknown or policy not in POLICIES:
        raise ConfigError(
            f"{where}: [subset] takes policy ({', '.join(POLICIES)}), fraction and masks, not "
            f"{unknown[0] if unknown else 'policy ' + repr(policy)}"
        )
    fraction, masks = subset.get("fraction", 0.0), ""
    if policy == "fraction":
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
            raise ConfigError(f"{where}: [subset] fraction must lie in (0, 1], not {fraction!r}")
    elif "fraction" in subset:
        raise ConfigError(f'{where}: [subset] fraction goes with policy = "fraction", not {policy!r}')
    if policy == "masks":
        if not isinstance(subset.get("masks"), str) or not subset["masks"]:
            raise ConfigError(f'{where}: [subset] policy "masks" needs masks = "FILE.npy" (bool [runs, images])')
        masks = str((base / subset["masks"]).resolve())
        check_masks(masks, runs)
    elif "masks" in subset:
        raise ConfigError(f'{where}: [subset] masks goes with policy = "masks", not {policy!r}')
    spec = Spec(
        preset,
        seed,
        runs,
        tuple(keep),
        {k: _plain(k, v) for k, v in settings.items()},
        {k: [_plain(k, v) for v in vs] for k, vs in axes.items()},
        policy,
        float(fraction),
        masks,
    )
    for arm in spec.arms:
        try:
            validate(spec.config(arm, 0, "runs", "cpu", masks))
        except ConfigError as exc:
            raise ConfigError(f"{where}: arm {arm.name}: {exc}") from None
        except (TypeError, ValueError) as exc:  # a value Config cannot even hold
            raise ConfigError(f"{where}: arm {arm.name}: {exc}") from None
    return spec


def from_dict(doc: dict) -> Spec:
    """The Spec a store holds (``Spec.as_dict``, checked when the store was made)."""
    sub = doc["subset"]
    settings = {k: _plain(k, v) for k, v in doc["settings"].items()}
    axes = {k: [_plain(k, v) for v in vs] for k, vs in doc["axes"].items()}
    return Spec(
        doc["preset"],
        doc["seed"],
        doc["runs"],
        tuple(doc["keep"]),
        settings,
        axes,
        sub["policy"],
        sub["fraction"],
        sub["masks"],
    )


def read(path: str) -> Spec:
    return parse(read_text(path), path, Path(path).resolve().parent)


def check_masks(path: str, runs: int, n_train: int | None = None) -> np.ndarray:
    """The masks file of policy "masks", mapped: bool [rows >= runs, images] (``n_train``: the
    data set's training images, when known)."""
    try:
        masks = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        text = why(exc) if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"[subset] masks {path}: cannot read it as a .npy: {text}") from None
    if masks.dtype != np.bool_ or masks.ndim != 2:
        raise ConfigError(
            f"[subset] masks {path}: must be bool [runs, training images], not {masks.dtype} {list(masks.shape)}"
        )
    if masks.shape[0] < runs:
        raise ConfigError(f"[subset] masks {path}: has {masks.shape[0]} rows, fewer than runs = {runs}")
    if n_train is not None and masks.shape[1] != n_train:
        raise ConfigError(
            f"[subset] masks {path}: rows of {masks.shape[1]} images, but the data has {n_train} training images"
        )
    return masks


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two specs as stored (``Spec.as_dict``), runs apart: "settings.lr",
    "axes", ..."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "runs":
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if json.dumps(a.get(k)) != json.dumps(b.get(k))]
        elif json.dumps(a) != json.dumps(b):
            out.append(key)
    return out
