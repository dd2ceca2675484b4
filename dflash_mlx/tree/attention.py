"""Attention layers over a flattened DDTree: mask, per-node RoPE, cache compaction.

The root and the tree's nodes run through a target's attention layers as one
flat sequence appended to the cache. Each node must see what it would see if
its own path had been fed as a chain:

- ``tree_mask``: the committed context and the node's ancestors and itself
  (boolean [N, offset+N]), and on a sliding layer only keys whose *position*
  lies within the window of the node's position;
- ``positioned``: each node rotated at position offset + depth, not at its
  flat index. The pass calls each attention layer through an ``Overlay`` that
  reads as the layer except that its attention's ``rope`` is a
  ``PositionedRope`` around its own, which hands ``mx.fast.rope`` one offset
  per token (the tokens laid out as its batch), so every RoPE variant that
  passes its offset straight to ``mx.fast.rope`` is rotated exactly as it
  rotates a chain; any other variant is refused. The model itself is never
  changed, so other threads can run it during the pass;
- ``compact``: after the walk, the accepted path's keys and values are
  gathered to the positions right after the context and the rest is trimmed.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

from ..errors import DFlashError

# RoPE modules whose call is mx.fast.rope(x, ..., offset=offset) and nothing
# else that depends on the offset (DynamicNTKScalingRoPE computes its base from it)
PER_TOKEN_ROPES = (nn.RoPE, Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE)


def ancestors(parents: mx.array, depth: int) -> mx.array:
    """Boolean [N, N]: entry (i, j) is true when j is i or one of its ancestors,
    for ``parents`` [N] int32 (-1 at the root) of a tree ``depth`` levels deep."""
    n = parents.size
    columns = mx.arange(n)[None]
    current = mx.arange(n)
    seen = current[:, None] == columns
    for _ in range(depth):
        current = mx.where(current >= 0, parents[mx.maximum(current, 0)], -1)
        seen = seen | (current[:, None] == columns)
    return seen


def tree_mask(parents: list[int], depths: list[int], offset: int, window=None) -> mx.array:
    """Boolean mask [N, offset+N] of the flattened tree (host lists ``parents``,
    -1 at the root, and ``depths``) after ``offset`` context positions;
    ``window`` (sliding layers) counts positions, as a chain's mask does."""
    positions = offset + mx.array(depths)
    context = mx.ones((len(parents), offset), dtype=mx.bool_)
    tree = ancestors(mx.array(parents), max(depths))
    if window:
        context = context & (mx.arange(offset)[None] > positions[:, None] - window)
        tree = tree & (positions[None] > positions[:, None] - window)
    return mx.concatenate([context, tree], axis=1)


class PositionedRope:
    """A layer's RoPE that rotates token t of a pass at ``positions[t]``."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        self.inner = rope
        self.positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # x [B, H, T, D] -> [T, B*H, 1, D]: one batch entry, and offset, per token
        B, H, T, D = x.shape
        rotated = self.inner(x.transpose(2, 0, 1, 3).reshape(T, B * H, 1, D), offset=self.positions)
        return rotated.reshape(T, B, H, D).transpose(1, 2, 0, 3)


class Overlay:
    """Reads as ``module`` except for the attributes given, and calls as it does
    (its class's ``__call__`` run with the overlay as ``self``): a changed view
    of one module for one call that leaves the module itself as it is."""

    def __init__(self, module: nn.Module, **replaced: Any):
        self.__dict__.update(replaced, _module=module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args, **kwargs):
        return type(self._module).__call__(self, *args, **kwargs)


def attention_of(layer: nn.Module) -> nn.Module:
    """The attention module of a target layer (``self_attn`` in every family)."""
    return layer.self_attn


def check_rope(layer: nn.Module) -> None:
    """DFlashError unless the layer's RoPE can rotate each token at its own position."""
    rope = attention_of(layer).rope
    if not isinstance(rope, PER_TOKEN_ROPES):
        raise DFlashError(f"tree verification does not support the target's RoPE ({type(rope).__name__})")


def positioned(layer: nn.Module, positions: mx.array) -> Overlay:
    """``layer`` as a callable whose attention rotates token t at ``positions[t]``."""
    attention = attention_of(layer)
    return Overlay(layer, self_attn=Overlay(attention, rope=PositionedRope(attention.rope, positions)))


def compact(cache, offset: int, path: list[int]) -> None:
    """Keep, after ``offset`` context positions, only the rows ``path`` (indices
    into the tree appended at ``offset``), in that order."""
    n = len(path)
    if path != list(range(n)):
        rows = mx.array(path) + offset

        def gather(x: mx.array) -> mx.array:
            x[..., offset : offset + n, :] = x[..., rows, :]
            return x

        cache.keys, cache.values = tree_map(gather, (cache.keys, cache.values))
    cache.trim(cache.offset - offset - n)
