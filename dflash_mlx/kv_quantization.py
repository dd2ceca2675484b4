"""A quantized KV cache on the target's full-attention layers (mlx-lm's
``QuantizedKVCache``), switched on where mlx-lm's ``generate_step`` switches it
on, so the output stays token-identical to mlx-lm run with the same
``kv_bits``, ``kv_group_size`` and ``quantized_kv_start``.

mlx-lm converts a cache after any pass that leaves it holding at least
``quantized_kv_start`` tokens; every later pass attends over quantized keys
and values. A pass starting at position s therefore sees a quantized cache
exactly when s > 0 and s >= start, whatever the passes before it were, and
the decoder converts at that point, before the pass. Two passes must not
straddle the start, since mlx-lm's would have seen the switch inside them: a
verified block is cut to end at the start (``block``), and the prompt's last
token is prefilled alone, as mlx-lm prefills it (``loop.prefill_chunks``).

Recurrent layers keep their ``ArraysCache``; sliding-window layers keep a plain
cache (mlx-lm cannot quantize its rotating one). ``QuantizedKVCache.trim`` only
moves the offset, so rollback stays exact.
"""

from dataclasses import dataclass

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from .errors import DFlashError
from .validate import KV_GROUP_SIZES

FULL_ATTENTION = "full_attention"  # the layer kind whose cache is quantized (targets/layer_kinds.py)


@dataclass(frozen=True)
class KVQuantization:
    """``bits`` per element in groups of ``group_size`` along the head
    dimension, from the pass that starts at or after ``start`` tokens."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    def check(self, target) -> None:
        """A one-line DFlashError where the target cannot take this quantization:
        layers that share K/V, or a head dimension the group size does not
        divide (naming the group sizes that do, if any)."""
        if len(target.make_cache()) < target.num_layers:
            raise DFlashError("kv_bits is not supported on targets whose layers share K/V (Gemma 4); "
                              "run without kv_bits (--kv-bits)")
        args = target.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
        if not fits:
            raise DFlashError(f"kv_bits cannot serve this target: its head dimension {head_dim} is not a multiple "
                              f"of any group size MLX quantizes ({', '.join(map(str, KV_GROUP_SIZES))}); "
                              "run without kv_bits (--kv-bits)")
        if head_dim % self.group_size:
            raise DFlashError(f"kv_group_size {self.group_size} does not divide the target's head dimension "
                              f"{head_dim}; use {' or '.join(map(str, fits))}")

    def convert(self, cache: list, kinds: list) -> None:
        """Before a pass: quantize, in place in the list, each full-attention
        cache that holds at least ``start`` tokens (and any)."""
        for i, (kind, c) in enumerate(zip(kinds, cache)):
            if kind.name == FULL_ATTENTION and hasattr(c, "to_quantized") and c.offset >= max(self.start, 1):
                cache[i] = c.to_quantized(group_size=self.group_size, bits=self.bits)

    def block(self, position: int, block_size: int) -> int:
        """The block to verify from ``position``: ``block_size``, cut to end at
        the start when it would run past it."""
        return self.start - position if position < self.start < position + block_size else block_size
