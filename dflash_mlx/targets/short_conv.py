"""The short-convolution layer kind (LiquidAI's LFM2, mlx-lm's ``lfm2``):
recording forward and exact rollback.

An LFM2 convolution layer keeps one array in an ``ArraysCache``: the last
``L_cache - 1`` gated inputs B*x of its depthwise causal convolution. The verify
pass runs the layer's own submodules in the order of
``mlx_lm.models.lfm2.Lfm2DecoderLayer`` with ``ShortConv`` and records the
convolution's whole input, the window it started from followed by the block's
B*x. Rolling back to ``keep`` tokens sets the window to that input's rows
``keep .. keep + L_cache - 2``, the rows that feeding only the kept tokens
leaves there: the same values, so the window is bit-identical and nothing is
re-run. The layer has no other state (no recurrence), so this is all its
rollback needs. ``check_forward`` proves the recording copy against the
model's own forward once per model instance.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..errors import DFlashError
from .gated_delta import GatedDelta


@dataclass
class ShortConvRecord:
    conv_input: mx.array  # [B, K-1+T, H]: the window before the block, then the block's B*x
    window: int  # K-1, the rows the cache keeps


def recording_layer(layer: nn.Module, x: mx.array, mask, cache: ArraysCache):
    """An LFM2 convolution layer over [B, T, H] that also returns its record."""
    if mask is not None or cache.lengths is not None:
        raise NotImplementedError("padded batches are not supported in verification")
    conv = layer.conv
    gate_in, gate_out, inputs = mx.split(conv.in_proj(layer.operator_norm(x)), 3, axis=-1)  # mlx-lm's B, C, x
    gated = gate_in * inputs
    window = conv.L_cache - 1
    state = cache[0]
    if state is None:
        state = mx.zeros((gated.shape[0], window, gated.shape[-1]), dtype=gated.dtype)
    conv_input = mx.concatenate([state, gated], axis=1)
    cache[0] = conv_input[:, -window:, :]
    cache.advance(x.shape[1])
    h = x + conv.out_proj(gate_out * conv.conv(conv_input))
    return h + layer.feed_forward(layer.ffn_norm(h)), ShortConvRecord(conv_input, window)


class ShortConv:
    """Layer kind of mlx-lm's lfm2 convolution layers (a ``conv`` with an
    ``L_cache``), whose cache is an ``ArraysCache`` holding the conv window."""

    name = "short_conv"

    @staticmethod
    def claims(layer: nn.Module) -> bool:
        return hasattr(getattr(layer, "conv", None), "L_cache")

    def cache(self, cache):
        if not isinstance(cache, ArraysCache):
            raise DFlashError(f"a short-convolution layer has a '{type(cache).__name__}' cache; "
                              "expected mlx-lm's ArraysCache")
        return cache

    mask = GatedDelta.mask  # mlx-lm's ssm mask over the same ArraysCache
    row_cache = GatedDelta.row_cache

    def __call__(self, layer: nn.Module, h: mx.array, mask, cache, record: bool):
        if record:
            return recording_layer(layer, h, mask, cache)
        return layer(h, mask, cache), None

    def rollback(self, cache: ArraysCache, record: ShortConvRecord, keep: int, block: int) -> None:
        cache[0] = mx.contiguous(record.conv_input[:, keep : keep + record.window, :])

    def rollback_rows(self, cache: ArraysCache, record: ShortConvRecord, keeps: list[int], block: int) -> None:
        rows = (mx.array(keeps, dtype=mx.int32)[:, None] + mx.arange(record.window, dtype=mx.int32))[..., None]
        cache[0] = mx.take_along_axis(record.conv_input, rows, axis=1)


SHORT_CONV = ShortConv()
