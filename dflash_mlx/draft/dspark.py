"""DSpark drafts: DFlash v1's backbone with the anchor as prediction slot 0, a
Markov head and a confidence head, in DeepSpec's layout (the other packagings
are read into it: ``dspark_packaging.py``). See docs/dspark.md.

With gamma the checkpoint's ``block_size``, the block [x_0, m, ..., m] (gamma
ids, x_0 the anchor) sits at positions p..p+gamma-1 right after the context and
attends to [context ; block] with no mask. Slot k-1's normed hidden state h_k
gives the base logits U_k = lm_head(h_k) for k = 1..gamma, slot 0 included, and
the walk goes left to right from x_0::

    z_k = U_k + W2 W1[x_{k-1}]            (the Markov head, rank r)
    x_k = argmax z_k, or x_k ~ q_k = the sampler's warp of z_k
    c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)   (the confidence head)

Our ``block_size`` is the verified width gamma + 1 (the anchor and its gamma
drafts), as for the other drafts; nothing drafts wider than gamma. With a
reduced drafting vocabulary (speculators' ``draft_vocab_size`` N), U_k and the
Markov term cover N target ids only (W2 has N rows; W1 is indexed by target
ids) and every other id gets -inf, as with ``vocab.py``'s reduced vocabulary.
"""

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from . import dflash2
from .dspark_gemma4 import Gemma4DraftLayer
from .dspark_packaging import DEEPSPEC, GEMMA4, deepspec_layout, packaging
from .model import FULL, DFlashDraft, DraftConfig
from .vocab import SubsetHead, head_over, place
from ..errors import DFlashError

# keys every DeepSpec config carries (its model asserts on them; there are no defaults)
REQUIRED = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors",
            "enable_confidence_head", "markov_rank")
_HEAD_KEYS = ("num_anchors", "enable_confidence_head", "confidence_head_with_markov", "markov_rank",
              "markov_head_type")
# frozen copies of the target's embedding and head (speculators' head: its rows at the
# draft's ids) and speculators' target-to-draft mask: the draft borrows the target's own
BORROWED = ("embed_tokens.", "lm_head.", "verifier_", "t2d")


def is_dspark(config: dict[str, Any]) -> bool:
    """Whether a draft config.json is a DSpark draft in a published packaging
    (DFlashError for a DSpark packaging not supported yet)."""
    return packaging(config) is not None


@dataclass
class DSparkConfig(DraftConfig):
    """A DraftConfig (``block_size`` = gamma + 1) plus the DSpark heads' keys,
    the RoPE layout, the reduced drafting vocabulary's size (None: all ids)
    and the backbone's layer: ``"qwen3"`` or ``"gemma4"`` (``Gemma4DSparkModel``,
    whose K may serve as V: ``attention_k_eq_v``)."""

    num_anchors: int = 0  # training only, but DeepSpec requires it
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    markov_rank: int = 0  # 0: no Markov head, z_k = U_k
    markov_head_type: str = "vanilla"
    rope_traditional: bool = False  # interleaved pairs (``rope_is_neox_style: false``)
    draft_vocab_size: Optional[int] = None
    layer_family: str = "qwen3"
    attention_k_eq_v: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DSparkConfig":
        cfg = deepspec_layout(cfg)
        missing = [key for key in REQUIRED if key not in cfg]
        if int(cfg.get("markov_rank") or 0) > 0 and "markov_head_type" not in cfg:
            missing.append("markov_head_type")
        if cfg.get("enable_confidence_head") and "confidence_head_with_markov" not in cfg:
            missing.append("confidence_head_with_markov")
        if missing:
            raise DFlashError(f"DSpark draft config.json has no {', '.join(missing)} "
                              "(DeepSpec writes every one; re-export the draft)")
        if cfg.get("sample_from_anchor", True) is not True:
            raise DFlashError("DSpark draft config says sample_from_anchor false (the fill-in layout, "
                              "slot 1 predicting first); dflash-mlx runs the anchor-first layout only")
        gamma = int(cfg["block_size"])
        stated = (cfg.get("dflash_config") or {}).get("block_size")
        if stated is not None and int(stated) != gamma:
            raise DFlashError(f"DSpark draft config states block_size {gamma} and dflash_config.block_size "
                              f"{stated}; they must match (the trained block)")
        if gamma < 1:
            raise DFlashError(f"DSpark draft config block_size is {gamma}; it must be >= 1")
        dflash = {"block_size": gamma + 1, "mask_token_id": cfg["mask_token_id"],
                  "target_layer_ids": cfg["target_layer_ids"]}
        layers = cfg["num_target_layers"]  # None: not stated (speculators' format), the target's then
        base = DraftConfig.from_dict({**cfg, "dflash_config": dflash, "num_target_layers": layers or 0})
        config = cls(
            **{f.name: getattr(base, f.name) for f in fields(DraftConfig) if f.name != "num_target_layers"},
            num_target_layers=None if layers is None else int(layers),
            num_anchors=int(cfg["num_anchors"]),
            enable_confidence_head=bool(cfg["enable_confidence_head"]),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            markov_rank=int(cfg["markov_rank"]),
            markov_head_type=str(cfg.get("markov_head_type", "vanilla")),
            rope_traditional=cfg.get("rope_is_neox_style", True) is False,
            draft_vocab_size=None if cfg.get("draft_vocab_size") is None else int(cfg["draft_vocab_size"]),
            layer_family=str(cfg.get("layer_family", "qwen3")),
            attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
        )
        config.validate()
        return config

    def validate(self) -> None:
        super().validate()
        ids, L = self.target_layer_ids, self.num_target_layers
        last = float("inf") if L is None else L - 1  # a layer count not stated: the pair check bounds them
        if any(b <= a for a, b in zip(ids, ids[1:])) or not all(0 <= i < last for i in ids):
            within = "0 and up" if L is None else f"0..{L - 2}"
            raise DFlashError(f"DSpark draft target_layer_ids {ids} must increase within {within} "
                              "(-1, the embedding output, is not supported)")
        if set(self.layer_types) != {FULL} or self.is_causal:
            raise DFlashError("DSpark draft config has sliding or causal layers; "
                              "a DSpark block attends with no mask (every layer full_attention)")
        if self.markov_rank < 0 or (self.markov_rank and self.markov_head_type != "vanilla"):
            raise DFlashError(f"DSpark draft Markov head '{self.markov_head_type}' (rank {self.markov_rank}) "
                              "is not supported; only the vanilla head (every published draft's) is")
        if self.confidence_head_with_markov and not self.markov_rank:
            raise DFlashError("DSpark draft config has confidence_head_with_markov but markov_rank 0")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashError(f"DSpark draft mask_token_id {self.mask_token_id} is outside the vocabulary")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise DFlashError(f"DSpark draft draft_vocab_size {self.draft_vocab_size} must be from 1 to "
                              f"{self.vocab_size - 1} (the target's vocabulary is {self.vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """DeepSpec's layout: the trained block and every key flat."""
        cfg = super().to_dict()
        dflash = cfg.pop("dflash_config")
        cfg.update(dflash, architectures=[DEEPSPEC], tie_word_embeddings=False, block_size=self.block_size - 1)
        cfg.update({key: getattr(self, key) for key in _HEAD_KEYS})
        if self.layer_family == "gemma4":  # Gemma 4's text config, as its full-attention layers read it
            rope = {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}
            cfg.update(architectures=[GEMMA4], model_type="gemma4_text", global_head_dim=self.head_dim,
                       num_global_key_value_heads=self.num_key_value_heads, attention_k_eq_v=self.attention_k_eq_v,
                       rope_parameters={"full_attention": rope}, rope_scaling=None)
        if self.rope_traditional:
            cfg["rope_is_neox_style"] = False
        if self.draft_vocab_size is not None:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        return cfg


class MarkovHead(nn.Module):
    """The vanilla Markov head: the bias W2 W1[x] over ``out_size`` drafted ids
    after target id x (names as DeepSpec's)."""

    def __init__(self, vocab_size: int, rank: int, out_size: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(tokens))


class ConfidenceHead(nn.Module):
    """c = sigmoid(proj(features)): the chance a slot's draft is accepted, its prefix accepted."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0].astype(mx.float32))


class DSparkDraft(DFlashDraft):
    """The DSpark network: v1's context path and attention, unmasked, plus its
    heads; ``d2t`` (a reduced drafting vocabulary only) maps the draft's index d
    to target id d + d2t[d], as the speculators format stores it."""

    # small heads whose rounding error goes straight into q: convert keeps them in float unless asked
    FLOAT_HEADS = ("markov_head", "confidence_head")

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        r, reduced = config.markov_rank, config.draft_vocab_size
        if config.rope_traditional:
            for layer in self.layers:
                layer.self_attn.rope = initialize_rope(config.head_dim, config.rope_theta, True, config.rope_scaling,
                                                       config.max_position_embeddings)
        self.markov_head = MarkovHead(config.vocab_size, r, reduced or config.vocab_size) if r else None
        width = config.hidden_size + (r if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.enable_confidence_head else None
        self.d2t = None if reduced is None else mx.zeros((reduced,), dtype=mx.int64)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names without a ``model.`` prefix (LiquidAI's), and without the
        borrowed copies (``BORROWED``); a reduced vocabulary's d2t map checked."""
        named = {name.removeprefix("model."): w for name, w in weights.items()}
        kept = {name: w for name, w in named.items() if not name.startswith(BORROWED)}
        if self.d2t is not None:
            n, vocab = self.d2t.size, self.config.vocab_size
            d2t = np.array(kept["d2t"], dtype=np.int64) if "d2t" in kept else np.zeros(0, dtype=np.int64)
            ids = np.arange(d2t.size) + d2t
            if ids.shape != (n,) or (ids[1:] <= ids[:-1]).any() or ids[0] < 0 or ids[-1] >= vocab:
                raise DFlashError(f"DSpark draft's d2t map does not give {n} increasing ids below {vocab} "
                                  "(draft index d stands for target id d + d2t[d]); re-export the draft")
        return kept

    @property
    def vocab_ids(self) -> Optional[mx.array]:
        """The target ids [N] a reduced drafting vocabulary covers (None: all)."""
        return None if self.d2t is None else mx.arange(self.d2t.size) + self.d2t.astype(mx.int32)

    def drafting_head(self, target: Any, head: Optional[SubsetHead]) -> Optional[SubsetHead]:
        """The head the proposer drafts with: ``head`` (or the target's: None),
        or the target's head over a reduced vocabulary's ids (then ``head`` must be None)."""
        ids = self.vocab_ids
        if ids is None:
            return head
        if head is not None:
            raise DFlashError(f"this DSpark draft drafts over its own {ids.size} ids (its draft_vocab_size); "
                              "a draft_vocab does not apply to it")
        return head_over(target, np.array(ids))

    def markov_bias(self, previous: mx.array) -> mx.array:
        """W2 W1[x] [1, V] after target id x [1]; -inf outside a reduced vocabulary."""
        bias = self.markov_head(previous)
        return bias if self.d2t is None else place(bias, self.vocab_ids, self.config.vocab_size)

    def markov_z(self, logits: mx.array, previous: mx.array) -> mx.array:
        """z = U + W2 W1[x] [1, V] from base logits U [1, V] after target id x [1]
        (U itself without a Markov head)."""
        return logits if self.markov_head is None else logits + self.markov_bias(previous)

    def block_ids(self, anchors: mx.array) -> mx.array:
        """[B, gamma]: each of the anchors [B], then gamma - 1 mask ids (always the trained width)."""
        masks = mx.full((anchors.size, self.config.block_size - 2), self.config.mask_token_id, dtype=anchors.dtype)
        return mx.concatenate([anchors[:, None], masks], axis=1)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array,
             draw: Callable[[mx.array], tuple[mx.array, Optional[mx.array]]]):
        """(drafted [n] int32, q [n, V] or None, c [n] or None) from the slots'
        normed hidden states [n, H] and base logits U [n, V], after anchor [1]:
        z_k = U_k + W2 W1[x_{k-1}], one row at a time, each drawn by
        ``draw(z [1, V]) -> (x [1], its log q [1, V] or None)`` (the sampler's
        ``draft``: argmax when greedy, else a draw from its warp of z)."""
        previous, drafted, qs = anchor.astype(mx.int32), [], []
        for k in range(logits.shape[0]):
            previous, q = draw(self.markov_z(logits[k : k + 1], previous))
            drafted.append(previous)
            qs.append(q)
        drafted = mx.concatenate(drafted).astype(mx.int32)
        q = None if qs[0] is None else mx.concatenate(qs)
        return drafted, q, self.confidence(hidden, mx.concatenate([anchor.astype(mx.int32), drafted[:-1]]))

    def greedy_walk(self, logits: mx.array, anchors: mx.array) -> mx.array:
        """drafted [B, n] int32: ``walk`` with the argmax for B blocks at once,
        from base logits [B, n, V], block r after anchors[r]."""
        previous, drafted = anchors.astype(mx.int32), []
        for k in range(logits.shape[1]):
            previous = mx.argmax(self.markov_z(logits[:, k], previous), axis=-1).astype(mx.int32)
            drafted.append(previous)
        return mx.stack(drafted, axis=1)

    def confidence(self, hidden: mx.array, previous: mx.array) -> Optional[mx.array]:
        """c_k [n] from hidden [n, H] and the tokens x_{k-1} [n] before each slot's draft."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(self.confidence_features(hidden, previous))

    def confidence_features(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """What the confidence head reads: hidden [..., H], with W1[x_{k-1}]
        beside it where the config says (``confidence_head_with_markov``)."""
        if self.config.confidence_head_with_markov:
            hidden = mx.concatenate([hidden, self.markov_head.markov_w1(previous).astype(hidden.dtype)], axis=-1)
        return hidden


class Gemma4DSparkDraft(DSparkDraft):
    """The DSpark network with Gemma 4's layer (``dspark_gemma4.py``)."""

    layer_class = Gemma4DraftLayer


def network_class(config: DraftConfig) -> type:
    """The draft network a parsed config describes (v1, DFlash2 or DSpark)."""
    if isinstance(config, DSparkConfig):
        return Gemma4DSparkDraft if config.layer_family == "gemma4" else DSparkDraft
    return dflash2.network_class(config)


def draft_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(network, config) classes a config.json names (by its ``architectures``)."""
    kind = packaging(config)
    if kind is None:
        return dflash2.draft_classes(config)
    return (Gemma4DSparkDraft if kind == "gemma4" else DSparkDraft), DSparkConfig
