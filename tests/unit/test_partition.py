"""Every rank keeps a fixed shard; together the shards cover the training set exactly once."""

import numpy as np
import pytest

from fastcifar.data import shard_indices


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
