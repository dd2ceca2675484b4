"""The published DSpark packagings, read into DeepSpec's flat layout (docs/dspark.md,
"Packagings").

- DeepSpec's (``architectures: ["Qwen3DSparkModel"]``): the layout itself; every
  key required, no defaults.
- DeepSpec's for Gemma 4 (``Gemma4DSparkModel``): the same keys on a copy of
  Gemma 4's text config, read as its full-attention layers read it (head width
  ``global_head_dim``, K = V heads, the ``full_attention`` RoPE); the network's
  layer is Gemma 4's (``dspark_gemma4.py``).
- LiquidAI's (``Lfm2DSparkDraftModel``): the same network with the context keys
  (``mask_token_id``, ``target_layer_ids``, ``num_target_layers``) nested in
  ``dflash_config``, interleaved RoPE (``rope_is_neox_style: false``), tensor
  names possibly under ``model.``, no embedding or head of its own.
- Red Hat's speculators format (``speculators_config``): the backbone in
  ``transformer_layer_config``, the feature layers as ``aux_hidden_state_layer_ids``
  (the hidden state *entering* each listed layer: ours are one lower), an
  optional reduced drafting vocabulary (``draft_vocab_size`` ids, the draft's
  index d standing for target id d + d2t[d]), and no count of the target's
  layers (``num_target_layers`` None unless the config adds it: the pair
  check then takes the target's).
"""

from typing import Any, Optional

from ..errors import DFlashError

DEEPSPEC = "Qwen3DSparkModel"
GEMMA4 = "Gemma4DSparkModel"
LIQUID = "Lfm2DSparkDraftModel"
# LiquidAI's context keys, nested where z-lab's DFlash configs keep them
_NESTED = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
           "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# the speculators format's own defaults for DSpark keys a config may leave out
_SPECULATORS_DEFAULTS = {"markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": False,
                         "confidence_head_with_markov": False, "num_anchors": 0}


def packaging(config: dict[str, Any]) -> Optional[str]:
    """'deepspec', 'gemma4', 'liquid', 'speculators' or None (not a DSpark draft);
    DFlashError for a speculators-format draft of another kind."""
    names = config.get("architectures") or []
    if "speculators_config" in config:
        kind = config.get("speculators_model_type") or (config["speculators_config"] or {}).get("algorithm")
        if kind != "dspark":
            raise DFlashError(f"speculators-format draft of type '{kind}' is not a DSpark draft; "
                              "only speculators_model_type 'dspark' is supported")
        return "speculators"
    kinds = {DEEPSPEC: "deepspec", GEMMA4: "gemma4", LIQUID: "liquid"}
    return next((kinds[n] for n in names if n in kinds), None)


def deepspec_layout(config: dict[str, Any]) -> dict[str, Any]:
    """A DSpark config.json in any packaging as DeepSpec's flat keys, plus
    ``rope_is_neox_style`` and ``draft_vocab_size`` where they differ from DeepSpec's."""
    kind = packaging(config)
    if kind == "liquid":
        return _liquid(config)
    if kind == "speculators":
        return _speculators(config)
    if kind == "gemma4":
        return _gemma4(config)
    return config


def _gemma4(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's text config as its full-attention layers read it (mlx-lm's own
    ``ModelArgs``, so a key left out takes Gemma 4's default), in the flat keys
    of the draft config, plus ``attention_k_eq_v`` and ``layer_family``."""
    from mlx_lm.models.gemma4_text import ModelArgs

    args = ModelArgs.from_dict(config)
    k_eq_v = bool(args.attention_k_eq_v)
    heads = args.num_global_key_value_heads if k_eq_v and args.num_global_key_value_heads else args.num_key_value_heads
    return {**config, "head_dim": args.global_head_dim or args.head_dim, "num_key_value_heads": heads,
            "rope_parameters": dict(args.rope_parameters.get("full_attention") or {}), "rope_scaling": None,
            "attention_k_eq_v": k_eq_v, "layer_family": "gemma4"}


def _liquid(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("dflash_config") or {}
    flat = {key: config[key] if key in config else nested[key] for key in _NESTED if key in config or key in nested}
    flat = {**config, **flat}
    flat.setdefault("num_anchors", 0)  # training only; LiquidAI does not write it
    # LiquidAI omits it; its confidence head reads [h ; W1[x]] ([1, H + r], which loading checks)
    flat.setdefault("confidence_head_with_markov", bool(flat.get("markov_rank")))
    flat.setdefault("rope_is_neox_style", False)
    return flat


def _speculators(config: dict[str, Any]) -> dict[str, Any]:
    backbone = config.get("transformer_layer_config")
    if not isinstance(backbone, dict):
        raise DFlashError("speculators DSpark draft config.json has no transformer_layer_config")
    missing = [k for k in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids") if config.get(k) is None]
    if missing:
        raise DFlashError(f"speculators DSpark draft config.json has no {', '.join(missing)}")
    gamma = int(config["block_size"])
    flat = {**backbone, **_SPECULATORS_DEFAULTS, **{k: config[k] for k in _SPECULATORS_DEFAULTS if k in config}}
    flat.update(block_size=gamma, mask_token_id=config["mask_token_id"], num_target_layers=config.get("num_target_layers"),
                target_layer_ids=[int(i) - 1 for i in config["aux_hidden_state_layer_ids"]],
                sample_from_anchor=_anchor_first(config, gamma))
    vocab = config.get("draft_vocab_size")
    if vocab is not None and int(vocab) != int(backbone.get("vocab_size", -1)):
        flat["draft_vocab_size"] = int(vocab)
    return flat


def _anchor_first(config: dict[str, Any], gamma: int) -> bool:
    """Whether slot 0 predicts (DSpark's layout), from ``sample_from_anchor`` or
    the proposal width speculators writes beside it (gamma when slot 0 predicts,
    gamma - 1 when it does not); DFlashError when neither says or they disagree."""
    stated = config.get("sample_from_anchor")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    implied = None if tokens is None else {gamma: True, gamma - 1: False}.get(int(tokens))
    if tokens is not None and implied is None:
        raise DFlashError(f"speculators DSpark draft proposes {tokens} tokens from a block of {gamma}; "
                          f"a DSpark block proposes {gamma} (or {gamma - 1} in the fill-in layout)")
    if stated is None and implied is None:
        raise DFlashError("speculators DSpark draft config states neither sample_from_anchor nor the proposal's "
                          "speculative_tokens, so its anchor layout is unknown")
    if stated is not None and implied is not None and bool(stated) != implied:
        raise DFlashError(f"speculators DSpark draft says sample_from_anchor {str(stated).lower()} but proposes "
                          f"{tokens} tokens from a block of {gamma}; they disagree")
    return bool(implied if stated is None else stated)
