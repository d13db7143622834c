"""fastcifar.data (load_dataset, shard_indices): reading CIFAR-10 in every layout, the cache, the
download's checksum, every bad input; every rank keeps a fixed shard, and together the shards cover
the training set exactly once."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle

import numpy as np
import pytest
from conftest import CLASSES, SHARED_JPEG, sort_by_label, tar_folder, write_image_folder, write_official
from PIL import Image

from fastcifar.data import DataError, load_dataset, shard_indices
from fastcifar.data.official import CIFAR10, download

quiet = lambda msg: None  # noqa: E731
ARCHIVE = CIFAR10.archive


def spec_at(url: str, md5: str):
    """CIFAR-10's release spec fetched from ``url`` with checksum ``md5`` (a local test server)."""
    return dataclasses.replace(CIFAR10, url=url, md5=md5)


def assert_same(ds, arrays, by_label=False):
    for split in ("train", "test"):
        images, labels = arrays[split]
        if by_label:
            images, labels = sort_by_label(images, labels)
        np.testing.assert_array_equal(getattr(ds, f"{split}_images"), images)
        np.testing.assert_array_equal(getattr(ds, f"{split}_labels"), labels)
    assert ds.classes == CLASSES


# --- official format ------------------------------------------------------------------------


def test_official_batch_folder(official_dir):
    folder, arrays = official_dir
    assert_same(load_dataset(folder, log=quiet), arrays)
    assert_same(load_dataset(folder.parent, log=quiet), arrays)  # the folder that holds it


def test_official_archive(official_dir, tmp_path):
    folder, arrays = official_dir
    archive = tar_folder(folder, tmp_path / ARCHIVE, "cifar-10-batches-py")
    ds = load_dataset(archive, cache_dir=tmp_path / "cache", log=quiet)
    assert_same(ds, arrays)
    assert ds.train_images.flags["C_CONTIGUOUS"] and ds.train_images.dtype == np.uint8


def test_official_archive_in_folder(official_dir, tmp_path):
    folder, arrays = official_dir
    holder = tmp_path / "holder"
    holder.mkdir()
    tar_folder(folder, holder / ARCHIVE, "cifar-10-batches-py")
    assert_same(load_dataset(holder, cache_dir=tmp_path / "cache", log=quiet), arrays)


def test_python3_pickles_with_str_keys(tmp_path):
    folder, arrays = write_official(tmp_path / "d")
    x, y = arrays["test"]
    data = x.transpose(0, 3, 1, 2).reshape(len(x), -1)
    (folder / "test_batch").write_bytes(pickle.dumps({"data": data, "labels": list(map(int, y))}, protocol=4))
    np.testing.assert_array_equal(load_dataset(folder, log=quiet).test_images, x)


# --- image folders --------------------------------------------------------------------------


def test_image_folder(image_folder, tmp_path):
    root, arrays = image_folder
    assert_same(load_dataset(root, cache_dir=tmp_path / "cache", log=quiet), arrays, by_label=True)


def test_image_folder_archive_with_top_folder(image_folder, tmp_path):
    root, arrays = image_folder
    archive = tar_folder(root, tmp_path / "imgs.tar.gz", "cifar10-png")
    assert_same(load_dataset(archive, cache_dir=tmp_path / "cache", log=quiet), arrays, by_label=True)


def test_cache_is_written_once_and_reused(image_folder, tmp_path, monkeypatch):
    root, arrays = image_folder
    cache = tmp_path / "cache"
    messages = []
    load_dataset(root, cache_dir=cache, log=messages.append)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npz", files
    assert any("decoding" in m for m in messages)

    def no_decoding(*args):
        raise AssertionError("decoded again although the cache was there")

    monkeypatch.setattr("fastcifar.data.folder._decode", no_decoding)
    assert_same(load_dataset(root, cache_dir=cache, log=quiet), arrays, by_label=True)
    assert not [p for p in cache.iterdir() if p.suffix != ".npz"], "temporary files left behind"


def test_each_decoder_has_its_own_cache(image_folder, tmp_path):
    """nvJPEG's pixels differ from PIL's (up to 32 levels on a GPU): a cache one decoder filled must
    not serve the other, or a run's figures would depend on which loader ran first on the data."""
    root, arrays = image_folder
    cache = tmp_path / "cache"
    load_dataset(root, cache_dir=cache, log=quiet)  # PIL

    def other(raws, wheres):
        return np.full((len(raws), 32, 32, 3), 9, np.uint8)

    other.name = "other"
    ds = load_dataset(root, cache_dir=cache, log=quiet, decode=other)
    assert (ds.train_images == 9).all(), "PIL's cache served the other decoder"
    assert len(list(cache.iterdir())) == 2
    assert_same(load_dataset(root, cache_dir=cache, log=quiet), arrays, by_label=True)


def test_edited_folder_is_decoded_again(image_folder, tmp_path):
    root, _ = image_folder
    cache = tmp_path / "cache"
    load_dataset(root, cache_dir=cache, log=quiet)
    img = next((root / "train").rglob("*.png"))
    Image.fromarray(np.full((32, 32, 3), 7, np.uint8)).save(img)
    ds = load_dataset(root, cache_dir=cache, log=quiet)
    assert (ds.train_images == 7).all(axis=(1, 2, 3)).any(), "the edited image was not re-read"


def test_corrupt_cache_is_rebuilt_not_trusted(image_folder, tmp_path):
    root, arrays = image_folder
    cache = tmp_path / "cache"
    load_dataset(root, cache_dir=cache, log=quiet)
    (npz,) = cache.iterdir()
    npz.write_bytes(npz.read_bytes()[:1000])  # a cache cut short by a crash
    assert_same(load_dataset(root, cache_dir=cache, log=quiet), arrays, by_label=True)


def test_cache_goes_next_to_writable_data(image_folder):
    root, _ = image_folder
    load_dataset(root, log=quiet)
    assert [p for p in root.parent.iterdir() if p.name.endswith(".npz")], "no cache next to the data"


def test_failed_decode_leaves_no_cache(tmp_path):
    root, _ = write_image_folder(tmp_path / "imgs")
    bad = next((root / "test").rglob("*.png"))
    bad.write_bytes(b"not an image")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="not a readable image"):
        load_dataset(root, cache_dir=cache, log=quiet)
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.skipif(not SHARED_JPEG.is_file(), reason="the JPEG copy of CIFAR-10 (cifar10-jpeg.tar.gz) is not present")
@pytest.mark.slow  # decodes the shared 60,000-image JPEG archive
def test_shared_jpeg_archive_loads_as_is(tmp_path):
    ds = load_dataset(SHARED_JPEG, cache_dir=tmp_path / "cache", log=quiet)
    assert ds.train_images.shape == (50000, 32, 32, 3) and ds.test_images.shape == (10000, 32, 32, 3)
    assert ds.classes == CLASSES
    assert np.bincount(ds.train_labels).tolist() == [5000] * 10
    assert np.bincount(ds.test_labels).tolist() == [1000] * 10
    # Real photographs, not blank decodes: the set's mean colour is CIFAR-10's within a few levels.
    np.testing.assert_allclose(ds.train_images.reshape(-1, 3).mean(0), [125.3, 123.0, 113.9], atol=4)


# --- download -------------------------------------------------------------------------------


def test_download_verifies_md5(official_dir, http_folder, tmp_path):
    folder, arrays = official_dir
    served, url = http_folder
    source = tar_folder(folder, served / "served.tar.gz", "cifar-10-batches-py")
    md5 = hashlib.md5(source.read_bytes()).hexdigest()
    dest = tmp_path / "dl"
    path = download(dest, progress=quiet, spec=spec_at(f"{url}/served.tar.gz", md5))
    assert path == dest / ARCHIVE and path.read_bytes() == source.read_bytes()
    assert list(dest.iterdir()) == [path], "the staging folder is gone"
    assert download(dest, progress=quiet, spec=spec_at("http://127.0.0.1:9/none", md5)) == path  # kept, not refetched


def test_download_checksum_mismatch_leaves_nothing(official_dir, http_folder, tmp_path):
    folder, _ = official_dir
    served, url = http_folder
    tar_folder(folder, served / "served.tar.gz", "cifar-10-batches-py")
    dest = tmp_path / "dl"
    with pytest.raises(DataError, match="checksum mismatch"):
        download(dest, progress=quiet, spec=spec_at(f"{url}/served.tar.gz", "0" * 32))
    assert not dest.exists(), "the folder the download made is gone with its staging folder"


def test_download_unreachable(http_folder, tmp_path):
    _, url = http_folder
    with pytest.raises(DataError, match="download of .* failed"):
        download(tmp_path / "dl", progress=quiet, spec=spec_at(f"{url}/missing.tar.gz", "0" * 32))
    assert not (tmp_path / "dl").exists(), "no empty folder left (tests/cli/test_cli.py: the messages)"


def test_existing_archive_with_wrong_md5_is_reported(tmp_path):
    dest = tmp_path / "dl"
    dest.mkdir()
    (dest / ARCHIVE).write_bytes(b"partial")
    with pytest.raises(DataError, match="checksum mismatch"):
        download(dest, progress=quiet, spec=spec_at("file:///nonexistent", "0" * 32))


# --- bad input ------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="no such file or folder.*--download"):
        load_dataset(tmp_path / "nope", log=quiet)


def test_unknown_layout_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(DataError, match="unknown layout"):
        load_dataset(tmp_path, log=quiet)


def test_unknown_layout_file(tmp_path):
    f = tmp_path / "data.zip"
    f.write_bytes(b"PK")
    with pytest.raises(DataError, match="unknown layout"):
        load_dataset(f, log=quiet)


def test_archive_of_neither_layout(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.txt").write_text("hello")
    archive = tar_folder(tmp_path / "stuff", tmp_path / "stuff.tar.gz", "stuff")
    with pytest.raises(DataError, match="unknown layout"):
        load_dataset(archive, cache_dir=tmp_path / "cache", log=quiet)


def test_truncated_archive(official_dir, tmp_path):
    folder, _ = official_dir
    archive = tar_folder(folder, tmp_path / ARCHIVE, "cifar-10-batches-py")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated or corrupt"):
        load_dataset(archive, cache_dir=tmp_path / "cache", log=quiet)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_not_gzip_archive(tmp_path):
    f = tmp_path / "x.tar.gz"
    f.write_bytes(b"\x00" * 1000)
    with pytest.raises(DataError, match="truncated or corrupt"):
        load_dataset(f, cache_dir=tmp_path / "cache", log=quiet)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"garbage that is not a pickle", "not a readable CIFAR-10 batch"),
        (None, "not a readable CIFAR-10 batch"),  # truncated: filled in below
        (pickle.dumps([1, 2, 3]), "expected a dict"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}), "without 'data' and 'labels'"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), "rows of 3072"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "2 images but 1 labels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 11]}), "labels outside"),
    ],
)
def test_corrupt_pickle(official_dir, payload, message):
    folder, _ = official_dir
    if payload is None:
        payload = (folder / "data_batch_1").read_bytes()[:500]
    (folder / "test_batch").write_bytes(payload)
    with pytest.raises(DataError, match=message):
        load_dataset(folder, log=quiet)


def test_hostile_pickle_is_refused(official_dir):
    folder, _ = official_dir

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": Boom(), b"labels": []}))
    with pytest.raises(DataError, match="refusing to load"):
        load_dataset(folder, log=quiet)


def test_missing_batch_file(official_dir):
    folder, _ = official_dir
    (folder / "data_batch_4").unlink()
    with pytest.raises(DataError, match="missing CIFAR-10 batch file 'data_batch_4'"):
        load_dataset(folder, log=quiet)


def test_wrong_image_size(tmp_path):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10, size=28)
    with pytest.raises(DataError, match="image is 28x28, expected 32x32"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)


def test_class_folders_that_do_not_match(tmp_path):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    (root / "test" / "truck").rename(root / "test" / "lorry")
    with pytest.raises(DataError, match=r"only in train: \['truck'\]; only in test: \['lorry'\]"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)


def test_empty_train_folder(tmp_path):
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "test").mkdir(parents=True)
    with pytest.raises(DataError, match="no images under train"):
        load_dataset(tmp_path / "d", cache_dir=tmp_path / "cache", log=quiet)


def test_subset_is_a_balanced_fixed_sample(image_folder, tmp_path):
    root, _ = image_folder
    ds = load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)
    a, b = ds.subset(30), ds.subset(30)
    assert len(a.train_labels) == 30 and len(set(a.train_labels.tolist())) > 5  # not one class
    np.testing.assert_array_equal(a.train_images, b.train_images)
    assert ds.subset(0) is ds


@pytest.mark.parametrize("n, world", [(50000, 8), (1003, 3), (10, 1), (7, 7)])
def test_shards_cover_exactly_once(n, world):
    shards = [shard_indices(n, r, world) for r in range(world)]
    together = np.concatenate(shards)
    assert len(together) == n and np.array_equal(np.sort(together), np.arange(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shard_is_fixed_and_mixed():
    a, b = shard_indices(1000, 1, 4), shard_indices(1000, 1, 4)
    assert np.array_equal(a, b)
    # not a contiguous block: an image folder's class-by-class order still reaches every rank
    labels = np.arange(1000) // 100
    assert len(set(labels[a].tolist())) == 10


def test_bad_rank():
    with pytest.raises(ValueError):
        shard_indices(10, 2, 2)
