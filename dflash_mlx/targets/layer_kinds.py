"""How each kind of target layer runs a pass and rolls back: the seam for new families.

A layer kind says which cache it runs on (from the model's own), the mask its
layers take, how it runs a layer (recording what rollback needs when asked),
and how it rolls its cache back to the first ``keep`` tokens of a verified
block. The target adapter (``adapter.py``) only ever talks to kinds.

- attention (full or sliding window): mlx-lm's own layer, a trimmable cache,
  rolled back by ``trim``;
- GatedDeltaNet (``gated_delta.py``): a recording forward, rolled back to a
  state the verify pass went through (kept every few steps, or replayed by a
  kernel);
- LFM2's short convolution (``short_conv.py``): a recording forward, rolled
  back by slicing the recorded convolution input.

A new recurrence (e.g. Mamba-2) is one new module with a kind like
``gated_delta.GatedDelta``, listed in ``RECURRENT_KINDS``.
"""

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from . import gated_delta, short_conv
from .rows import RowKVCache
from ..errors import DFlashError


class LayerKind(Protocol):
    name: str

    def cache(self, cache: Any) -> Any:
        """The cache to run on, given the model's own (DFlashError if it cannot roll back)."""

    def mask(self, h: mx.array, cache: Any) -> Any:
        """The mask every layer of this kind takes for hidden states ``h``."""

    def __call__(self, layer: nn.Module, h: mx.array, mask: Any, cache: Any, record: bool) -> tuple[mx.array, Any]:
        """(output, record for rollback or None)."""

    def rollback(self, cache: Any, record: Any, keep: int, block: int) -> None:
        """Leave ``cache`` as if only the first ``keep`` of ``block`` tokens had been fed."""

    def row_cache(self, cache: Any) -> Any:
        """A request's cache as a one-row cache of a batch (``rows.py``), which
        ``extend``, ``filter`` and ``extract`` like mlx-lm's batch caches."""

    def rollback_rows(self, cache: Any, record: Any, keeps: list[int], block: int) -> None:
        """Per row r of a batch's cache, keep the first ``keeps[r]`` of ``block`` tokens."""


RECURRENT_KINDS: tuple = (gated_delta.GATED_DELTA, short_conv.SHORT_CONV)


def _check_trimmable(cache: Any) -> None:
    """mlx-lm's own capability check (``is_trimmable``), as its prompt-cache code asks it."""
    if not (hasattr(cache, "is_trimmable") and cache.is_trimmable()):
        raise DFlashError(
            f"target cache type '{type(cache).__name__}' cannot be rolled back (it is not trimmable)"
        )


@dataclass(frozen=True)
class Attention:
    """Full attention (``window`` None) or sliding-window attention."""

    name: str
    window: Optional[int] = None

    def cache(self, cache: Any) -> Any:
        if isinstance(cache, RotatingKVCache):
            # trimmable only until it wraps: a sliding layer keeps every
            # position instead and applies the window in its mask (the same attention)
            if self.window and cache.keep == 0:
                return KVCache()
            raise DFlashError("a rotating KV cache (max_kv_size) cannot be rolled back once it wraps; "
                              "use the model's default cache")
        _check_trimmable(cache)
        return cache

    def mask(self, h: mx.array, cache: Any) -> Any:
        return create_attention_mask(h, cache, window_size=self.window)

    def __call__(self, layer: nn.Module, h: mx.array, mask: Any, cache: Any, record: bool):
        return layer(h, mask, cache), None

    def rollback(self, cache: Any, record: Any, keep: int, block: int) -> None:
        _check_trimmable(cache)
        cache.trim(block - keep)

    def row_cache(self, cache: KVCache) -> RowKVCache:
        if cache.keys is None:
            return RowKVCache(lengths=[0])
        n = cache.offset
        return RowKVCache(cache.keys[..., :n, :], cache.values[..., :n, :], lengths=[n])

    def rollback_rows(self, cache: RowKVCache, record: Any, keeps: list[int], block: int) -> None:
        cache.trim_rows([block - keep for keep in keeps])


def layer_kinds(inner: nn.Module, layers: list) -> list[LayerKind]:
    """The kind of every layer: a recurrent kind that claims it, else sliding
    attention (the layer's flag, the model's ``layer_types`` or the layer's
    ``layer_type``), else full."""
    # gpt-oss names them on the model, Gemma 4 on each layer
    types = getattr(inner, "layer_types", None) or [getattr(layer, "layer_type", None) for layer in layers]
    window = getattr(inner, "sliding_window", None) or getattr(inner, "window_size", None)
    full, sliding = Attention("full_attention"), Attention("sliding_attention", window)
    kinds = []
    for layer, layer_type in zip(layers, types):
        recurrent = [k for k in RECURRENT_KINDS if k.claims(layer)]
        if recurrent:
            kinds.append(recurrent[0])
        elif getattr(layer, "use_sliding", False) or layer_type == "sliding_attention":
            if not window:
                raise DFlashError("the target has sliding-window layers but no window size")
            kinds.append(sliding)
        else:
            kinds.append(full)
    return kinds
