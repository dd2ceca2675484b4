"""DSpark drafts in DeepSpec's packaging (``architectures: ["Qwen3DSparkModel"]``):
DFlash v1's backbone with the anchor as prediction slot 0, a Markov head and a
confidence head. See docs/dspark.md.

With gamma the checkpoint's ``block_size``, the block [x_0, m, ..., m] (gamma
ids, x_0 the anchor) sits at positions p..p+gamma-1 right after the context and
attends to [context ; block] with no mask. Slot k-1's normed hidden state h_k
gives the base logits U_k = lm_head(h_k) for k = 1..gamma, slot 0 included, and
the walk goes left to right from x_0::

    z_k = U_k + W2 W1[x_{k-1}]            (the Markov head, rank r)
    x_k = argmax z_k, or x_k ~ q_k = the sampler's warp of z_k
    c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)   (the confidence head)

Our ``block_size`` is the verified width gamma + 1 (the anchor and its gamma
drafts), as for the other drafts; nothing drafts wider than gamma.
"""

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from . import dflash2
from .model import FULL, DFlashDraft, DraftConfig
from ..errors import DFlashError

ARCHITECTURE = "Qwen3DSparkModel"
# DSpark packagings this module does not load yet (docs/dspark.md, "Refused layouts")
NOT_YET = ("Gemma4DSparkModel", "Lfm2DSparkDraftModel")
# keys every DeepSpec config carries (its model asserts on them; there are no defaults)
REQUIRED = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors",
            "enable_confidence_head", "markov_rank")
_HEAD_KEYS = ("num_anchors", "enable_confidence_head", "confidence_head_with_markov", "markov_rank",
              "markov_head_type")
# the target's own embedding and head: DeepSpec stores frozen copies, the draft borrows the target's
BORROWED = ("embed_tokens.", "lm_head.")


def is_dspark(config: dict[str, Any]) -> bool:
    """Whether a draft config.json names DeepSpec's Qwen3 DSpark architecture
    (DFlashError for a DSpark packaging not supported yet)."""
    names = config.get("architectures") or []
    later = [f"{n} (DSpark)" for n in names if n in NOT_YET] + ["speculators-format"] * ("speculators_config" in config)
    if later:
        raise DFlashError(f"{later[0]} drafts are not supported yet; "
                          f"a DSpark draft must be a {ARCHITECTURE} (DeepSpec's Qwen3 packaging)")
    return ARCHITECTURE in names


@dataclass
class DSparkConfig(DraftConfig):
    """A DraftConfig (``block_size`` = gamma + 1) plus the DSpark heads' keys."""

    num_anchors: int = 0  # training only, but DeepSpec requires it
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    markov_rank: int = 0  # 0: no Markov head, z_k = U_k
    markov_head_type: str = "vanilla"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DSparkConfig":
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
        base = DraftConfig.from_dict({**cfg, "dflash_config": dflash})
        config = cls(
            **{f.name: getattr(base, f.name) for f in fields(DraftConfig)},
            num_anchors=int(cfg["num_anchors"]),
            enable_confidence_head=bool(cfg["enable_confidence_head"]),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            markov_rank=int(cfg["markov_rank"]),
            markov_head_type=str(cfg.get("markov_head_type", "vanilla")),
        )
        config.validate()
        return config

    def validate(self) -> None:
        super().validate()
        ids, L = self.target_layer_ids, self.num_target_layers
        if any(b <= a for a, b in zip(ids, ids[1:])) or not all(0 <= i < L - 1 for i in ids):
            raise DFlashError(f"DSpark draft target_layer_ids {ids} must increase within 0..{L - 2} "
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

    def to_dict(self) -> dict[str, Any]:
        """DeepSpec's layout: the trained block and every key flat."""
        cfg = super().to_dict()
        dflash = cfg.pop("dflash_config")
        cfg.update(dflash, architectures=[ARCHITECTURE], tie_word_embeddings=False, block_size=self.block_size - 1)
        cfg.update({key: getattr(self, key) for key in _HEAD_KEYS})
        return cfg


class MarkovHead(nn.Module):
    """The vanilla Markov head: the bias W2 W1[x] after token x (names as DeepSpec's)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

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
    """The DSpark network: v1's context path and attention, unmasked, plus its heads."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        r = config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, r) if r else None
        width = config.hidden_size + (r if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.enable_confidence_head else None

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Without DeepSpec's copies of the target's embedding and head (``BORROWED``)."""
        return {name: w for name, w in weights.items() if not name.startswith(BORROWED)}

    def block_ids(self, anchor: mx.array) -> mx.array:
        """[1, gamma]: the anchor, then gamma - 1 mask ids (always the trained width)."""
        masks = mx.full((self.config.block_size - 2,), self.config.mask_token_id, dtype=anchor.dtype)
        return mx.concatenate([anchor, masks])[None]

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array,
             draw: Callable[[mx.array], tuple[mx.array, Optional[mx.array]]]):
        """(drafted [n] int32, q [n, V] or None, c [n] or None) from the slots'
        normed hidden states [n, H] and base logits U [n, V], after anchor [1]:
        z_k = U_k + W2 W1[x_{k-1}], one row at a time, each drawn by
        ``draw(z [1, V]) -> (x [1], its log q [1, V] or None)`` (the sampler's
        ``draft``: argmax when greedy, else a draw from its warp of z)."""
        previous, drafted, qs = anchor.astype(mx.int32), [], []
        for k in range(logits.shape[0]):
            z = logits[k : k + 1]
            if self.markov_head is not None:
                z = z + self.markov_head(previous)
            previous, q = draw(z)
            drafted.append(previous)
            qs.append(q)
        drafted = mx.concatenate(drafted).astype(mx.int32)
        q = None if qs[0] is None else mx.concatenate(qs)
        return drafted, q, self.confidence(hidden, mx.concatenate([anchor.astype(mx.int32), drafted[:-1]]))

    def confidence(self, hidden: mx.array, previous: mx.array) -> Optional[mx.array]:
        """c_k [n] from hidden [n, H] and the tokens x_{k-1} [n] before each slot's draft."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            hidden = mx.concatenate([hidden, self.markov_head.markov_w1(previous).astype(hidden.dtype)], axis=-1)
        return self.confidence_head(hidden)


def network_class(config: DraftConfig) -> type:
    """The draft network a parsed config describes (v1, DFlash2 or DSpark)."""
    return DSparkDraft if isinstance(config, DSparkConfig) else dflash2.network_class(config)


def draft_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(network, config) classes a config.json names (by its ``architectures``)."""
    return (DSparkDraft, DSparkConfig) if is_dspark(config) else dflash2.draft_classes(config)
