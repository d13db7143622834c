"""A study's spec (fastcifar/sweep/spec.py): the arms, each run's Config, and every bad spec refused in
one line before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastcifar.core.config import ConfigError
from fastcifar.sweep import spec as specs

BASE = {
    "preset": "fast",
    "seed": 5,
    "runs": 3,
    "keep": ["test_margins", "train_margins"],
    "settings": {"data": "data", "widths": [16, 32, 32], "epochs": 1},
    "axes": {"lr": [0.2, 0.4], "label_smoothing": [0.0, 0.1]},
    "subset": {"policy": "fraction", "fraction": 0.5},
}


def parse(doc, tmp_path=None):
    return specs.parse(doc, "spec.json", tmp_path or ".")


def test_the_arms_are_the_axes_product_in_the_specs_order():
    spec = parse(BASE)
    assert [a.name for a in spec.arms] == [
        "lr=0.2,label_smoothing=0.0",
        "lr=0.2,label_smoothing=0.1",
        "lr=0.4,label_smoothing=0.0",
        "lr=0.4,label_smoothing=0.1",
    ]
    assert spec.arms[3].values == {"lr": 0.4, "label_smoothing": 0.1}
    assert [a.name for a in parse({**BASE, "axes": {}}).arms] == ["base"]


def test_run_i_of_every_arm_has_the_same_seed_and_its_own_settings():
    spec = parse(BASE)
    for arm in spec.arms:
        cfg = spec.config(arm, 2, "store/runs/9", "cpu")
        assert (cfg.seed, cfg.runs, cfg.out_dir, cfg.device, cfg.quiet) == (7, 1, "store/runs/9", "cpu", True)
        assert (cfg.lr, cfg.label_smoothing) == (arm.values["lr"], arm.values["label_smoothing"])
        assert cfg.widths == (16, 32, 32) and cfg.subset_fraction == 0.5 and cfg.subset_mask == ""
        assert cfg.save_outputs == "both" and cfg.save_model is False


@pytest.mark.parametrize(
    "keep, outputs, model",
    [
        (["test_logits"], "test", False),
        (["train_margins"], "train", False),
        (["model"], "none", True),
        ([], "none", False),
    ],
)
def test_keep_chooses_the_outputs_and_the_model_file(keep, outputs, model):
    cfg = parse({**BASE, "keep": keep}).config(parse(BASE).arms[0], 0, "o", "cpu")
    assert (cfg.save_outputs, cfg.save_model) == (outputs, model)


def test_toml_and_json_read_the_same(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text(
        'preset = "fast"\nseed = 5\nruns = 3\nkeep = ["test_margins", "train_margins"]\n'
        '[settings]\ndata = "data"\nwidths = [16, 32, 32]\nepochs = 1\n'
        "[axes]\nlr = [0.2, 0.4]\nlabel_smoothing = [0.0, 0.1]\n"
        '[subset]\npolicy = "fraction"\nfraction = 0.5\n'
    )
    js = tmp_path / "s.json"
    js.write_text(json.dumps(BASE))
    assert specs.read(str(toml)).as_dict() == specs.read(str(js)).as_dict()


def test_a_spec_as_stored_comes_back_the_same():
    spec = parse(BASE)
    again = specs.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert again == spec and again.arms == spec.arms


def masks_file(tmp_path, array) -> str:
    np.save(tmp_path / "m.npy", array)
    return "m.npy"


def test_a_masks_file_is_read_relative_to_the_spec_and_each_run_gets_its_row(tmp_path):
    name = masks_file(tmp_path, np.ones((4, 300), bool))
    spec = parse({**BASE, "subset": {"policy": "masks", "masks": name}}, tmp_path)
    assert spec.masks == str((tmp_path / name).resolve())
    cfg = spec.config(spec.arms[0], 1, "o", "cpu", "work/mask-7.npy")
    assert cfg.subset_mask == "work/mask-7.npy" and cfg.subset_fraction == 0.0


def edit(path: str, value):
    doc = json.loads(json.dumps(BASE))
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(
    "path, value, says",
    [
        ("color", "red", "unknown key 'color'"),
        ("runs", KeyError, "how many runs per arm"),
        ("runs", 0, "runs must be a whole number in 1.."),
        ("runs", 2.5, "runs must be a whole number"),
        ("seed", -1, "seed must be a whole number"),
        ("keep", ["weights"], "keep is a list of"),
        ("settings.seed", 3, "seed is set by the sweep"),
        ("settings.device", "cuda", "device is set by the sweep, from --devices"),
        ("settings.subset_fraction", 0.3, "subset_fraction is set by the sweep"),
        ("settings.colour", 1, "unknown setting 'colour'"),
        ("settings.epochs", -1, "arm lr=0.2,label_smoothing=0.0: --epochs"),
        ("settings.widths", [16, 32], "--widths takes three"),
        ("axes.lr", [], "axis lr must be a non-empty list"),
        ("axes.lr", [0.2, 0.2], "axis lr names a value twice"),
        ("axes.batch_size", [100, 0], "arm lr=0.2,label_smoothing=0.0,batch_size=0: --batch-size"),
        ("axes.data", ["a"], "data is both a setting and an axis"),
        ("subset", {"policy": "half"}, "[subset] takes policy"),
        ("subset", {"policy": "fraction", "fraction": 1.5}, "fraction must lie in (0, 1]"),
        ("subset", {"policy": "all", "fraction": 0.5}, 'fraction goes with policy = "fraction"'),
        ("subset", {"policy": "masks"}, 'policy "masks" needs masks'),
        ("settings", [1], "[settings] must be a table"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_problem(path, value, says):
    with pytest.raises(ConfigError) as err:
        parse(edit(path, value))
    text = str(err.value)
    assert says in text and "\n" not in text, text


@pytest.mark.parametrize(
    "array, says",
    [
        (np.ones((2, 300), bool), "has 2 rows, fewer than runs = 3"),
        (np.ones(300, bool), "must be bool [runs, training images]"),
        (np.ones((4, 300), np.int64), "must be bool [runs, training images], not int64"),
    ],
)
def test_a_masks_file_of_the_wrong_shape_is_one_line(tmp_path, array, says):
    name = masks_file(tmp_path, array)
    with pytest.raises(ConfigError, match=None) as err:
        parse({**BASE, "subset": {"policy": "masks", "masks": name}}, tmp_path)
    assert says in str(err.value)


def test_masks_of_the_wrong_length_for_the_data_are_refused(tmp_path):
    name = masks_file(tmp_path, np.ones((3, 299), bool))
    with pytest.raises(ConfigError, match="rows of 299 images, but the data has 300"):
        specs.check_masks(str(tmp_path / name), 3, n_train=300)


@pytest.mark.parametrize(
    "name, text, says", [("s.toml", "runs = [", "not valid TOML"), ("s.json", "{runs: 1", "not valid JSON")]
)
def test_a_file_that_does_not_parse_is_one_line(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=says):
        specs.read(str(tmp_path / name))
    with pytest.raises(ConfigError, match="cannot read the spec"):
        specs.read(str(tmp_path / "missing.json"))


def test_differences_name_the_keys_that_changed_and_leave_runs_alone():
    old = parse(BASE).as_dict()
    new = parse({**edit("settings.epochs", 2), "runs": 9}).as_dict()
    assert specs.differences(old, new) == ["settings.epochs"]
    assert specs.differences(old, parse({**BASE, "runs": 10}).as_dict()) == []
    assert specs.differences(old, parse(edit("axes.lr", [0.3])).as_dict()) == ["axes.lr"]
