"""Any number of classes: official CIFAR-100 (read and downloaded), image folders of 11 classes."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import tarfile

import numpy as np
import pytest
import torch
from cli import run_dirs, summary_of
from conftest import one_line_error
from PIL import Image

from fastcifar import checkpoint as checkpoint_cmd
from fastcifar.core.config import Config
from fastcifar.data import load_dataset, official
from fastcifar.evaluate import evaluate
from fastcifar.models.files import load_model
from fastcifar.run.report import RunLog, device_info, versions
from fastcifar.run.sparse import diffs
from fastcifar.train import main as train_main

quiet = lambda msg: None  # noqa: E731
# A tiny ResNet-9 run: what matters here is the class count, not accuracy.
TINY = [
    "--preset",
    "resnet9",
    "--device",
    "cpu",
    "--widths",
    "8,8,16,16",
    "--batch-size",
    "50",
    "--epochs",
    "1",
    "--warmup-epochs",
    "0",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "100",
    "--loader",
    "torch",
]


def images_of(labels: np.ndarray, n_classes: int, seed: int) -> np.ndarray:
    templates = np.random.default_rng(7).integers(0, 256, (n_classes, 4, 4, 3)).repeat(8, 1).repeat(8, 2)
    noise = np.random.default_rng(seed).normal(0, 20, (len(labels), 32, 32, 3))
    return np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)


def write_cifar100(root, per_class_train=3, per_class_test=1):
    """cifar-100-python/ as the release lays it out: train, test (fine and coarse labels), meta."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    names = [f"fine{i:02d}" for i in range(100)]
    arrays = {}
    for split, per, seed in (("train", per_class_train, 1), ("test", per_class_test, 2)):
        labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(100), per))
        images = images_of(labels, 100, seed)
        (folder / split).write_bytes(
            pickle.dumps(
                {
                    b"filenames": [b"x.png"] * len(labels),
                    b"batch_label": split.encode(),
                    b"fine_labels": labels.tolist(),
                    b"coarse_labels": (labels // 5).tolist(),
                    b"data": images.transpose(0, 3, 1, 2).reshape(len(labels), -1),
                },
                protocol=2,
            )
        )
        arrays[split] = (images, labels)
    (folder / "meta").write_bytes(
        pickle.dumps({b"fine_label_names": [n.encode() for n in names], b"coarse_label_names": [b"c"] * 20}, protocol=2)
    )
    return folder, names, arrays


def test_cifar100_folder_and_archive_read_fine_labels(tmp_path):
    folder, names, arrays = write_cifar100(tmp_path / "d")
    archive = tmp_path / "cifar-100-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-100-python")
    for source in (folder, tmp_path / "d", archive):
        ds = load_dataset(source, log=quiet)
        assert ds.classes == tuple(names), source
        np.testing.assert_array_equal(ds.train_images, arrays["train"][0])
        np.testing.assert_array_equal(ds.train_labels, arrays["train"][1])  # fine, not coarse
        np.testing.assert_array_equal(ds.test_labels, arrays["test"][1])


def test_cifar100_hostile_meta_is_refused(tmp_path):
    folder, _, _ = write_cifar100(tmp_path / "d")

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": Evil()}))
    with pytest.raises(official.DataError, match="refusing to load builtins.print"):
        load_dataset(folder, log=quiet)


@pytest.mark.slow  # over 2 s on 2 cores
def test_download_set_cifar100(tmp_path, http_folder, monkeypatch):
    folder, names, _ = write_cifar100(tmp_path / "src")
    served, url = http_folder
    with tarfile.open(served / "c100.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-100-python")
    md5 = hashlib.md5((served / "c100.tar.gz").read_bytes()).hexdigest()
    monkeypatch.setitem(
        official.OFFICIAL_SETS, "cifar100", dataclasses.replace(official.CIFAR100, url=f"{url}/c100.tar.gz", md5=md5)
    )
    ds = load_dataset(tmp_path / "dl", download_missing=True, download_set="cifar100", log=quiet)
    assert (tmp_path / "dl" / "cifar-100-python.tar.gz").is_file() and ds.classes == tuple(names)


@pytest.mark.slow  # over 2 s on 2 cores
def test_cifar100_trains_a_100_class_net(tmp_path, capfd):
    folder, names, _ = write_cifar100(tmp_path / "d")
    out = tmp_path / "runs"
    assert train_main([*TINY, "--data", str(folder), "--out-dir", str(out)]) == 0, capfd.readouterr().err
    (run_dir,) = run_dirs(out)
    log_text = (run_dir / "log.txt").read_text()
    assert "100 classes (fine00, fine01" in log_text  # the header names them
    # the data line (the terminal's too): the count and a few names; log.txt and summary.json: every name, once
    (data_line,) = [ln for ln in log_text.splitlines() if ln.startswith("data: ")]
    assert data_line.endswith("100 classes (fine00, fine01, fine02, ...)"), data_line
    assert f"classes: {', '.join(names)}" in log_text.splitlines()
    doc = summary_of(out)
    assert doc["classes"] == list(names) and "fine03" not in doc["data"]
    assert all("classes" not in r for r in doc["results"])
    model, info = load_model(run_dir / "model.safetensors")
    assert info.classes == tuple(names) and model.fc.weight.shape[0] == 100


def test_the_terminal_gets_a_few_class_names_and_log_txt_all(tmp_path):
    names = [f"fine{k:02d}" for k in range(100)]
    terminal = io.StringIO()
    log = RunLog(Config(), str(tmp_path), enabled=True, stream=terminal)
    log.start(
        {
            "versions": versions(),
            "device": device_info(torch.device("cpu"), 1),
            "data": "d: 300 train, 100 test images, 100 classes",
            "classes": names,
        }
    )
    log.stop("failed", "the header is all this test needs")
    shown = terminal.getvalue()
    assert "data: d: 300 train, 100 test images, 100 classes (fine00, fine01, fine02, ...)\n" in shown
    assert "fine03" not in shown and max(map(len, shown.splitlines())) < 200
    assert f"classes: {', '.join(names)}\n" in (log.dir / "log.txt").read_text()


def write_folder(root, train_classes, test_classes, per_class=(6, 2)):
    for split, classes, n in (("train", train_classes, per_class[0]), ("test", test_classes, per_class[1])):
        for k, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i, img in enumerate(images_of(np.full(n, k), len(classes), seed=10 * k + len(split))):
                Image.fromarray(img).save(root / split / name / f"{i}.png")
    return root


@pytest.mark.slow  # over 2 s on 2 cores
def test_eleven_class_folders_train_an_eleven_class_net(tmp_path, capfd):
    classes = [f"kind{k:02d}" for k in range(11)]  # label 10 exists: a 10-output net would fail on it
    data = write_folder(tmp_path / "imgs", classes, classes)
    out = tmp_path / "runs"
    assert train_main([*TINY, "--data", str(data), "--out-dir", str(out), "--batch-size", "22"]) == 0, (
        capfd.readouterr().err
    )
    (run_dir,) = run_dirs(out)
    assert "11 classes (kind00, kind01" in (run_dir / "log.txt").read_text()
    model, info = load_model(run_dir / "model.safetensors")
    assert info.classes == tuple(classes) and model.fc.weight.shape[0] == 11
    # a model file is a diff chain's base: restoring and evaluating it builds the same 11-class net
    state, meta = diffs.restore(run_dir / "model.safetensors", [])
    assert checkpoint_cmd.evaluate_state(state, meta, str(data)) == evaluate((model, info), str(data)).accuracy


def test_train_and_test_class_sets_that_differ_are_refused(tmp_path, capfd):
    data = write_folder(tmp_path / "imgs", ["ant", "bee", "cat"], ["ant", "bee", "dog"])
    out = tmp_path / "runs"
    assert train_main([*TINY, "--data", str(data), "--out-dir", str(out)]) == 2
    line = one_line_error(capfd.readouterr().err)
    assert (
        "class folders of train/ and test/ differ" in line
        and "only in train: ['cat']" in line
        and "only in test: ['dog']" in line
    )
