"""The indices of the k largest entries of each row, in two small partitions
instead of one over the whole vocabulary.

MLX's ``argpartition`` over a vocabulary-wide row is slow where it matters:
its Metal backend sorts the whole row, and its CPU one took 23-33 ms for 15
rows of 151,936 (a Qwen vocabulary) on this project's 2-core machine. Split
each row into chunks, take every chunk's maximum, keep the k chunks with the
largest maxima, and partition only their k * chunk entries: 1.9 ms there
(docs/benchmarks.md, "The top k of a vocabulary"). With chunks of 128 and
k = 16 both partitions fit one Metal threadgroup's sort for vocabularies up
to 262,144.

The kept entries always hold a top k. Let t be the k-th largest value and m
(< k) the number of entries above it. Each chunk holding one of those has a
maximum above t: fewer than k chunks do, and all are kept. If fewer than k
chunks reach t at all, every one of them is kept, so every entry of at least
t is; otherwise the k - c other kept chunks (c <= m being those above t)
each have maximum t, so at least k - m entries equal to t are kept beside
the m above it. Which of several entries tied at t come back is left to the
partition, as ``argpartition``'s own choice is.
"""

import mlx.core as mx

SMALLEST = 16  # the smallest chunk; rows whose length has no power-of-two factor this large partition whole
SORT_BLOCK = 2048  # entries one Metal threadgroup sorts (MLX's single-block sort: 512 threads x 4)


def chunk_size(width: int, k: int) -> int:
    """The chunk a row of ``width`` entries is split into: the largest power
    of two that divides it, with the k kept chunks' entries within one
    ``SORT_BLOCK`` and at least 4k chunks to keep them from; 0 where no such
    chunk of at least ``SMALLEST`` exists (the row is partitioned whole)."""
    chunk = 1
    while width % (2 * chunk) == 0 and 2 * chunk * k <= SORT_BLOCK and width // (2 * chunk) >= 4 * k:
        chunk *= 2
    return chunk if chunk >= SMALLEST else 0


def top_k_ids(x: mx.array, k: int) -> mx.array:
    """Indices [..., k] (int32, in no particular order) of the k largest
    entries of each row of ``x`` [..., V], 1 <= k <= V."""
    *lead, width = x.shape
    chunk = chunk_size(width, k)
    if not chunk:
        return mx.argpartition(-x, k - 1, axis=-1)[..., :k].astype(mx.int32)
    chunks = x.reshape(*lead, width // chunk, chunk)
    kept = mx.argpartition(-chunks.max(axis=-1), k - 1, axis=-1)[..., :k]  # [..., k] chunk indices
    entries = mx.take_along_axis(chunks, kept[..., None], axis=-2).reshape(*lead, k * chunk)
    best = mx.argpartition(-entries, k - 1, axis=-1)[..., :k]  # positions within the kept entries
    return (mx.take_along_axis(kept, best // chunk, axis=-1) * chunk + best % chunk).astype(mx.int32)


def ranked_top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(values, ids) [..., k] of the k largest entries of each row, best first."""
    ids = top_k_ids(x, k)
    values = mx.take_along_axis(x, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)
