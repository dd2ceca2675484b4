"""The DFlash2 draft: a DFlash draft whose every sublayer is wrapped in a short
causal convolution inside the block, with a candidate selector
(``selector.py``) over its logits. See docs/dflash2.md.

Each layer, with u the normed sublayer input and (D_pre, D_post) =
``kernel_projection(u)`` viewed per row as [2, K, G]::

    h = h + conv(Attn(conv(u; base[0], D_pre), ctx); base[1], D_post)

and the same around the MLP with ``post_attention_layernorm`` and
``mlp_conv``. ``conv(x; B, D)[t, c] = sum_{o<K} (B[o, c] + D[t, o, c // gs]) *
x[t - o, c]``, with x = 0 before the block's first row: it runs over the block
only, never the context. Attention, the context cache and KV injection are the
v1 draft's (``model.py``); the published drafts set ``is_causal: false``.

Logits of block rows 1..b-1 are ``lm_head(norm(h)) * output_multiplier``, then
``cap * tanh(z / cap)`` when ``final_logit_softcapping`` is set, and the block
embedding is scaled by ``input_embedding_scale``, as for v1 drafts
(``DFlashDraft.scale_logits``).
"""

from dataclasses import dataclass, fields
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .model import DFlashDraft, DraftConfig, DraftLayer
from .selector import CODEBOOKS, CandidateSelector
from ..errors import DFlashError

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config keys a DFlash2 draft needs (z-lab defaults them to 0, which cannot run)
_SELECTOR_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def is_dflash2(config: dict[str, Any]) -> bool:
    """Whether a draft config.json names the DFlash2 architecture."""
    return ARCHITECTURE in (config.get("architectures") or [])


@dataclass
class DFlash2Config(DraftConfig):
    """A DraftConfig plus the convolution and selector keys of ``dflash_config``
    (a ``dflash_config`` key wins over a top-level one)."""

    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DFlash2Config":
        base = DraftConfig.from_dict(cfg)
        dflash = cfg.get("dflash_config") or {}
        get = lambda key: dflash.get(key, cfg.get(key, 0))
        config = cls(
            **{f.name: getattr(base, f.name) for f in fields(DraftConfig)},
            **{key: int(get(key)) for key in _SELECTOR_KEYS},
        )
        config.validate()
        return config

    def validate(self) -> None:
        super().validate()
        for key in _SELECTOR_KEYS:
            if getattr(self, key) < 1:
                raise DFlashError(f"DFlash2 draft config has no positive dflash_config.{key}")
        if self.hidden_size % self.conv_group_size:
            raise DFlashError(
                f"DFlash2 draft conv_group_size {self.conv_group_size} does not divide "
                f"hidden_size {self.hidden_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        cfg = super().to_dict()
        cfg["architectures"] = [ARCHITECTURE]
        cfg["dflash_config"].update({key: getattr(self, key) for key in _SELECTOR_KEYS})
        return cfg


@mx.compile
def grouped_conv(x: mx.array, base: mx.array, dynamic: mx.array, group_size: int) -> mx.array:
    """Causal conv over the rows of x [B, L, H]: static taps base [K, H] plus
    dynamic taps dynamic [B, L, K, G], one per row and channel group. The K
    shifted copies of x are stacked and weighed in one product (about 18 graph
    nodes at K = 2, where a loop over the taps takes 30), compiled so its
    elementwise ops fuse."""
    B, L, H = x.shape
    K, G = base.shape[0], H // group_size
    padded = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
    # slot s holds row t - (K - 1 - s), weighed by tap K - 1 - s
    windows = mx.stack([padded[:, s : s + L] for s in range(K)], axis=2).reshape(B, L, K, G, group_size)
    taps = base[::-1].reshape(K, G, group_size) + dynamic[:, :, ::-1, :, None]
    return (taps.astype(x.dtype) * windows).sum(axis=2).reshape(B, L, H)


class GroupedDynamicConv(nn.Module):
    """The two convolutions around one sublayer; tensor names as z-lab's."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def __call__(self, u: mx.array, sublayer: Callable[[mx.array], mx.array]) -> mx.array:
        """conv(sublayer(conv(u; base[0], D_pre)); base[1], D_post), both taps from u."""
        B, L, H = u.shape
        dynamic = self.kernel_projection(u).reshape(B, L, 2, self.kernel_size, H // self.group_size)
        x = grouped_conv(u, self.base_kernel[0], dynamic[:, :, 0], self.group_size)
        return grouped_conv(sublayer(x), self.base_kernel[1], dynamic[:, :, 1], self.group_size)


class DFlash2Layer(DraftLayer):
    def __init__(self, config: DFlash2Config, layer_type: str):
        super().__init__(config, layer_type)
        K, gs = config.conv_kernel_size, config.conv_group_size
        self.attention_conv = GroupedDynamicConv(config.hidden_size, K, gs)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, K, gs)

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = x + self.attention_conv(self.input_layernorm(x), lambda u: self.self_attn(u, cache))
        return h + self.mlp_conv(self.post_attention_layernorm(h), self.mlp)


class DFlash2Draft(DFlashDraft):
    """The DFlash2 network: v1's context path and attention, conv-wrapped
    sublayers, and the candidate selector."""

    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size,
                                                    config.selector_rank, config.selector_top_k)

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """z-lab stores the two codebooks without ``.weight``; they load as embedding tables."""
        out = dict(weights)
        for name in CODEBOOKS:
            key = f"candidate_selector.{name}"
            if key in out:
                out[f"{key}.weight"] = out.pop(key)
        return out

    @staticmethod
    def hf_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Our weights under z-lab's names (``sanitize``'s inverse): the codebooks without ``.weight``."""
        out = dict(weights)
        for name in CODEBOOKS:
            key = f"candidate_selector.{name}"
            if f"{key}.weight" in out:
                out[key] = out.pop(f"{key}.weight")
        return out


def network_class(config: DraftConfig) -> type:
    """The draft network a parsed config describes."""
    return DFlash2Draft if isinstance(config, DFlash2Config) else DFlashDraft


def draft_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(network, config) classes a config.json names (by its ``architectures``)."""
    return (DFlash2Draft, DFlash2Config) if is_dflash2(config) else (DFlashDraft, DraftConfig)
