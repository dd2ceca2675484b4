"""The draft's context cache holds what a block query can still see: sliding
layers drop older positions (bounded memory) without changing a single logit."""

import mlx.core as mx
import numpy as np
import pytest
from test_draft import H, V, randomized, reference_logits, small_config

from dflash_mlx.draft.cache import DraftContextCache


def _run(draft, caches, features, block, embed, chunk=3):
    for start in range(0, features.shape[1], chunk):
        draft.inject(features[:, start:start + chunk], caches)
    return draft(embed[block], caches)


@pytest.mark.parametrize("window", [2, 3, 6])
def test_bounded_sliding_caches_give_the_same_logits(window):
    draft = randomized(small_config(sliding_window=window))  # sliding, full, sliding
    rng = np.random.default_rng(window)
    features = mx.array(rng.normal(size=(1, 40, 2 * H)), dtype=mx.float32)
    embed = mx.array(rng.normal(size=(V, H)), dtype=mx.float32)
    block = mx.array([[5, V - 1, V - 1, V - 1]])
    bounded = [DraftContextCache(keep=c.keep, slack=2) for c in draft.make_cache()]
    unbounded = [DraftContextCache() for _ in draft.layers]
    got = _run(draft, bounded, features, block, embed)
    assert mx.array_equal(got, _run(draft, unbounded, features, block, embed))
    np.testing.assert_allclose(np.array(got @ embed.T)[0], reference_logits(draft, features, embed[block], embed),
                               rtol=1e-4, atol=1e-4)
    sliding = [bounded[0], bounded[2]]
    assert all(c.offset == 40 and c.start > 0 and c.held <= window - 1 + 2 + 3 for c in sliding)
    assert bounded[1].start == 0 and bounded[1].held == 40  # the full layer keeps everything


def test_draft_caches_keep_the_window_by_default():
    draft = randomized(small_config(sliding_window=5))
    keeps = [c.keep for c in draft.make_cache()]
    assert keeps == [4, None, 4]


def test_trimming_below_the_held_window_is_refused():
    cache = DraftContextCache(keep=3, slack=1)
    x = mx.zeros((1, 1, 10, 4))
    cache.update_and_fetch(x, x)
    cache.compact()
    assert (cache.start, cache.offset) == (7, 10)
    assert cache.can_trim(0) and not cache.can_trim(1)  # position 9 would need 6..8, 6 is gone
    full = DraftContextCache()
    full.update_and_fetch(x, x)
    full.compact()
    assert full.start == 0 and full.can_trim(10) and full.trim(4) == 4 and full.offset == 6
