"""``top_k_ids``: a top k of every row, found through the rows' chunks."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.top_k import SMALLEST, chunk_size, top_k_ids


def assert_a_top_k(x: np.ndarray, ids: np.ndarray, k: int) -> None:
    """Each row's ids are k distinct indices whose values are the row's k largest."""
    assert ids.shape == (*x.shape[:-1], k)
    rows, picked = x.reshape(-1, x.shape[-1]), ids.reshape(-1, k)
    for row, chosen in zip(rows, picked):
        assert len(set(chosen.tolist())) == k and chosen.min() >= 0 and chosen.max() < row.size
        np.testing.assert_array_equal(np.sort(row[chosen]), np.sort(row)[-k:])


@pytest.mark.parametrize("width", [4096, 151936, 1000, 96])
@pytest.mark.parametrize("lead", [(7,), (2, 7), (1, 15)])
def test_the_ids_are_a_top_k_of_each_row(width, lead):
    x = np.random.default_rng(width).standard_normal((*lead, width)).astype(np.float32)
    assert_a_top_k(x, np.array(top_k_ids(mx.array(x), 16)), 16)


def test_rows_are_split_where_their_length_allows_and_partitioned_whole_elsewhere():
    assert chunk_size(4096, 16) == 64 and chunk_size(151936, 16) == 128 and chunk_size(248320, 16) == 128
    assert 4096 // 64 >= 4 * 16 and 16 * 128 <= 2048
    assert chunk_size(50257, 16) == chunk_size(1000, 16) == 0  # no power-of-two factor of SMALLEST or more
    assert chunk_size(96, 16) == 0 and SMALLEST == 16  # too few entries for 4k chunks


def test_ties_and_masked_entries():
    """Many entries equal to the k-th value, and rows with fewer than k finite
    entries (a reduced drafting vocabulary's -inf): still a top k, every index
    within the row."""
    rng = np.random.default_rng(1)
    ties = rng.integers(0, 4, size=(5, 4096)).astype(np.float32)  # about 1,000 entries tie at the top
    assert_a_top_k(ties, np.array(top_k_ids(mx.array(ties), 16)), 16)
    masked = np.full((3, 4096), -np.inf, dtype=np.float32)
    masked[:, rng.choice(4096, 5, replace=False)] = rng.standard_normal((3, 5))
    ids = np.array(top_k_ids(mx.array(masked), 16))
    assert_a_top_k(masked, ids, 16)
    finite = np.isfinite(np.take_along_axis(masked, ids, axis=-1)).sum(axis=-1)
    assert (finite == 5).all()  # every finite entry is among them


def test_a_winner_alone_in_its_chunk_beside_chunks_of_near_winners_is_found():
    """The k largest spread over k chunks, each chunk's other entries far below:
    partitioning the chunks by anything but their maxima would miss them."""
    x = np.full((1, 4096), -10.0, dtype=np.float32)
    winners = np.arange(16) * 256 + 7  # one per chunk of 64, 4 chunks apart
    x[0, winners] = 5.0 + np.arange(16)
    x[0, 64 * 3 : 64 * 4] = 4.0  # a whole chunk just below them: the largest sum, not the largest maximum
    ids = np.array(top_k_ids(mx.array(x), 16))
    assert sorted(ids[0].tolist()) == winners.tolist()
