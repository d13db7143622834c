"""The command line of ``fastcifar train``: ``--preset`` (or ``--config FILE``), then one flag per
Config field, each defaulting to the preset's value, listed by ``--help`` in its field's group with
its field's help text. Nothing in the package imports this but the commands (and the scripts that
name a run by its flags: ``recipe_flags``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from fastcifar.core.config import (
    CHOICES,
    CONFIG_FILE,
    HELP_GROUPS,
    TRAJECTORY_FREE_FIELDS,
    Config,
    flag_name,
    from_preset,
    read_config_file,
    with_overrides,
)
from fastcifar.core.errors import ConfigError
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default as a user types it: 6 significant digits (a preset's derived rates are
    long fractions), widths comma-separated; nothing for a flag without one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        value = action.default
        if isinstance(value, float):
            shown = f"{value:.6g}"
        elif isinstance(value, (tuple, list)):
            shown = ",".join(map(str, value))
        else:
            shown = str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr, ``fastcifar: error: ...``, and exit 2, as every other bad input
    (argparse's own prints the usage first). Every command's parser is one."""

    def error(self, message: str):
        self.exit(2, f"fastcifar: error: {message} (see {self.prog} --help)\n")


def _parse_widths(text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parse_epochs(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid epoch count {text!r}: expected a number such as 24 or 9.9") from None
    return int(value) if value.is_integer() else value


ARCH_NAMES = {"resnet9": "ResNet-9", "fastnet": "FastNet", "alexnet": "AlexNet"}


def _description() -> str:
    d = from_preset(DEFAULT_PRESET)
    optimizer = {"muon": "Muon on the conv filters", "sgd": "Nesterov SGD"}[d.optimizer]
    return (
        f"Train a network on CIFAR-10 (or CIFAR-100, or your own image folders), on one device or "
        f"data-parallel under torchrun. The default preset, {DEFAULT_PRESET}, trains "
        f"{ARCH_NAMES[d.arch]} {'/'.join(map(str, d.widths))} for {d.epochs:g} epochs at batch "
        f"{d.batch_size} with {optimizer}; --preset resnet9 is the ResNet-9 seed recipe. Every field of "
        f"the run's config has a flag; the preset sets their defaults. --lr is the peak learning rate "
        f"for the mean loss per 512 images of global batch: the run's peak is --lr x --batch-size / 512 "
        f"(the default preset: {d.lr:g} x {d.batch_size} / 512 = {d.lr * d.batch_size / 512:.4g}), and "
        f"the log's lr column prints the rate at each epoch's last step on that scale (the peak times "
        f"the schedule)."
    )


def build_parser(base: Config, prog: str = "python -m fastcifar.train") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        allow_abbrev=False,  # --warmup-epo would pass for --warmup-epochs
        usage="%(prog)s [--preset NAME] [--data PATH] [--download] [--device DEVICE] [OPTION ...]",
        description=_description(),
        formatter_class=_HelpFormatter,
    )
    groups = {key: parser.add_argument_group(title) for key, title in HELP_GROUPS.items() if title is not None}
    groups["testing"] = parser  # the harness's switches: flags without a --help line
    groups["basic"].add_argument(
        "--preset", default=base.preset, choices=list(PRESETS), help="named recipe that sets the defaults below"
    )
    groups["basic"].add_argument(
        "--config",
        default=argparse.SUPPRESS,  # no "(default: None)" in --help; parse_command_line reads it first
        metavar="FILE",
        help=f"a run folder's {CONFIG_FILE}: its settings are the defaults (the options given override them), "
        "so one command repeats a run",
    )
    for f in fields(Config):
        group = f.metadata["group"]
        if group is None:  # set another way (preset: --preset or --config)
            continue
        default = getattr(base, f.name)
        shown = f.metadata["help"].replace("%", "%%") if HELP_GROUPS[group] is not None else argparse.SUPPRESS
        kwargs: dict[str, Any] = {"default": default, "help": shown}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "tta":  # a level; bare --tta means flip TTA, --no-tta (below) means none
            kwargs.update(type=int, nargs="?", const=1)
        elif isinstance(default, tuple):
            kwargs["type"] = _parse_widths
        elif f.name in ("epochs", "whiten_bias_epochs"):  # whole (24, 3) or fractional (9.9, 0.19)
            kwargs["type"] = _parse_epochs
        elif f.type == "float":  # a preset's whole default (lr 1) must not make the flag refuse 0.5
            kwargs["type"] = float
        else:
            kwargs["type"] = type(default)
        if f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        groups[group].add_argument(f"--{flag_name(f.name)}", dest=f.name, **kwargs)
        if f.name == "tta":
            groups[group].add_argument("--no-tta", dest="tta", action="store_const", const=0, help="same as --tta 0")
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "python -m fastcifar.train") -> Config:
    return parse_command_line(argv, prog)[0]


def parse_command_line(
    argv: list[str] | None = None, prog: str = "python -m fastcifar.train"
) -> tuple[Config, dict[str, Any]]:
    """The run's config, and the fields given explicitly on the command line with their values
    (``--resume`` takes the checkpoint's settings for the others: run.state.resume_settings)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=DEFAULT_PRESET)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.preset not in PRESETS:
        build_parser(Config(), prog).error(f"unknown preset {known.preset!r}; choose from {', '.join(PRESETS)}")
    base = from_preset(known.preset)
    if known.config is not None:  # a saved run's settings are the defaults; the flags given still override them
        if _given(argv, "--preset"):
            build_parser(base, prog).error(
                "--config holds its preset and settings: give --preset or --config, not both"
            )
        try:
            base = read_config_file(known.config)
        except ConfigError as exc:
            build_parser(base, prog).error(str(exc))
    args = vars(build_parser(base, prog).parse_args(argv))
    args.pop("config", None)
    preset = args.pop("preset")
    # no abbreviations (allow_abbrev=False), so the flag is given exactly as --warmup-epochs[=V]
    if not _given(argv, "--warmup-epochs"):
        del args["warmup_epochs"]  # a changed --epochs scales the warm-up (the preset's, or the file's)
    cfg = with_overrides(base, args)  # base: the preset's settings (known.preset is preset) or the file's
    # A second parse with no defaults: only what the command line names (argparse's own trick).
    quiet = build_parser(base, prog)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    given = vars(quiet.parse_args(argv))
    given.pop("config", None)
    return cfg, {k: (getattr(cfg, k) if k != "preset" else preset) for k in given}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


RECIPE_FREE_FIELDS = ("seed", "runs")  # which seeds, and how many: the same recipe either way


def recipe_flags(config: dict) -> list[str]:
    """The command-line flags that turn the preset ``config`` names into ``config`` (a config as
    plain data, as summary.json holds it), over the fields that shape the recipe, in field order:
    ``["--widths 64,288,288", "--epochs 7"]``. A report names a variant of a preset by them. A field
    missing from ``config`` counts as the preset's; a changed ``epochs`` scales the preset's warm-up,
    as on the command line, so only a warm-up given besides it is named."""
    plain = from_preset(config.get("preset", DEFAULT_PRESET))
    scaled = from_preset(plain.preset, epochs=config.get("epochs", plain.epochs))

    def as_data(value):  # tuples and lists alike, as JSON holds them
        return json.loads(json.dumps(value))

    flags = []
    for f in fields(Config):
        name = f.name
        if name not in config or name == "preset" or name in TRAJECTORY_FREE_FIELDS + RECIPE_FREE_FIELDS:
            continue
        value = as_data(config[name])
        if value == as_data(getattr(plain if name == "epochs" else scaled, name)):
            continue
        if isinstance(value, bool):
            flags.append(f"--{flag_name(name)}" if value else f"--no-{flag_name(name)}")
        elif isinstance(value, list):
            flags.append(f"--{flag_name(name)} {','.join(map(str, value))}")
        elif isinstance(value, float):  # repr: the shortest text that gives the value back
            flags.append(f"--{flag_name(name)} {value!r}")
        else:
            flags.append(f"--{flag_name(name)} {value}")
    return flags
