"""What a draft is trained for: its shape, objective and data settings, and the
``DraftConfig`` (``DFlash2Config`` for ``arch="dflash2"``, ``DSparkConfig`` for
``arch="dspark"``) it gets for a given target."""

from dataclasses import asdict, dataclass
from typing import Optional

from ..draft import FULL, SLIDING, DFlash2Config, DraftConfig, DSparkConfig, default_target_layer_ids
from ..errors import DFlashError
from ..targets import Target


ARCHS = ("dflash", "dflash2", "dspark")
DFLASH2_OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DSPARK_OPTIONS = ("markov_rank",)


@dataclass
class DraftTrainConfig:
    """What to train (the draft's shape) and on what."""

    # draft shape
    arch: str = "dflash"  # "dflash2": conv-wrapped sublayers and a candidate selector;
    # "dspark": the anchor as prediction slot 0, a Markov head and a confidence head
    num_layers: int = 1
    target_layer_ids: Optional[list[int]] = None  # default: the published spreading rule
    block_size: int = 16
    mask_token_id: Optional[int] = None  # default: the tokenizer's mask token, else V-1
    num_attention_heads: Optional[int] = None  # default: the target's
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    rope_theta: float = 1e6
    sliding_window: Optional[int] = None  # all layers but the last slide when set
    # objective and batches
    seq_len: int = 256
    batch_size: int = 8
    blocks_per_seq: int = 8
    gamma: float = 7.0  # loss weight exp(-(k-1)/gamma) at block position k
    cache_features: bool = False  # self-distillation: run the target once per sequence (fp16 in RAM)
    # data
    self_distill: bool = False
    num_prompts: int = 2000
    distill_tokens: int = 192
    prompt_lengths: tuple = (16, 32, 48, 64, 96, 128)
    distill_batch: int = 32
    # held-out evaluation of tau with the real generation loop
    eval_prompts: int = 8
    eval_tokens: int = 128
    eval_every: int = 0  # checkpoints between evals; 0: at the end only
    # DFlash2 only (docs/dflash2.md): conv taps K and channels per dynamic tap,
    # the selector's rank R and candidates k, and the weight of its loss
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_weight: float = 1.0
    # DSpark only (docs/training.md, "DSpark drafts"): the Markov head's rank r
    # (a V x r embedding and an r x V projection; 0: no Markov head)
    markov_rank: int = 256

    def settings(self) -> dict:
        """The settings a resumed run must share: only its own architecture's
        fields (so runs written before the other architectures' fields existed
        still resume; a v1 run's omit ``arch`` too)."""
        out = asdict(self)
        unused = {"dflash": ("arch", *DFLASH2_OPTIONS, "selector_weight", *DSPARK_OPTIONS),
                  "dflash2": DSPARK_OPTIONS, "dspark": (*DFLASH2_OPTIONS, "selector_weight")}
        for name in unused.get(self.arch, ()):
            out.pop(name)
        return out


def _text_args(model):
    text = getattr(model, "language_model", model)
    return text.args


def draft_config_for(target: Target, cfg: DraftTrainConfig, mask_token_id: int) -> DraftConfig:
    """A draft config sized for ``target`` (shape fields default to the target's)."""
    args = _text_args(target.model)
    L, H = target.num_layers, target.hidden_size
    heads = cfg.num_attention_heads or getattr(args, "num_attention_heads")
    kv = cfg.num_key_value_heads or getattr(args, "num_key_value_heads", None) or heads
    head_dim = cfg.head_dim or getattr(args, "head_dim", None) or H // heads
    inter = cfg.intermediate_size or getattr(args, "intermediate_size")
    ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else None
    if ids is None:
        ids = default_target_layer_ids(L, cfg.num_layers)
        ids = sorted({min(max(i, 0), L - 1) for i in ids})
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise DFlashError(f"target_layer_ids {bad} are outside the target's {L} layers")
    n = cfg.num_layers
    if n < 1:
        raise DFlashError(f"the draft needs at least one layer, got {n}")
    layer_types = [FULL] * n
    if cfg.sliding_window:
        layer_types = [SLIDING] * (n - 1) + [FULL]
    if cfg.arch not in ARCHS:
        raise DFlashError(f"unknown draft architecture '{cfg.arch}'; choose {' or '.join(ARCHS)}")
    dflash2 = {name: getattr(cfg, name) for name in DFLASH2_OPTIONS} if cfg.arch == "dflash2" else {}
    if dflash2 and cfg.selector_top_k > target.vocab_size:
        raise DFlashError(f"the selector's k ({cfg.selector_top_k}, --selector R,k) is larger than the target's "
                          f"vocabulary of {target.vocab_size} tokens; choose k of at most {target.vocab_size}")
    if cfg.arch == "dspark" and cfg.markov_rank < 0:
        raise DFlashError(f"the Markov head's rank must be 0 or more, got {cfg.markov_rank}")
    dspark = dict(  # DeepSpec's heads, as every published DSpark draft has them (docs/dspark.md)
        num_anchors=cfg.blocks_per_seq, enable_confidence_head=True,
        confidence_head_with_markov=cfg.markov_rank > 0, markov_rank=cfg.markov_rank, markov_head_type="vanilla",
    ) if cfg.arch == "dspark" else {}
    kind = DFlash2Config if dflash2 else DSparkConfig if dspark else DraftConfig
    config = kind(
        **dflash2,
        **dspark,
        hidden_size=H,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=target.vocab_size,
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        num_target_layers=L,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 32768) or 32768),
        layer_types=layer_types,
        sliding_window=cfg.sliding_window if cfg.sliding_window else None,
    )
    config.validate()
    return config


def mask_token_id(tokenizer, target: Target, requested: Optional[int]) -> int:
    """The requested id, else the tokenizer's mask token, else the last vocabulary id."""
    V = target.vocab_size
    if requested is not None:
        if not 0 <= requested < V:
            raise DFlashError(f"mask_token_id {requested} is outside the target vocabulary ({V})")
        return int(requested)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    mask = getattr(hf, "mask_token_id", None)
    if isinstance(mask, int) and 0 <= mask < V:
        return mask
    return V - 1
