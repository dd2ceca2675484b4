"""The draft network against a plain NumPy reading of the DFlash equations,
and draft config parsing (both dialects, published sizes)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import DFlashDraft, DFlashError, DraftConfig

H, V, TARGET_LAYERS = 32, 64, 6


def small_config(**overrides) -> DraftConfig:
    cfg = dict(
        hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, vocab_size=V, num_target_layers=TARGET_LAYERS,
        rms_norm_eps=1e-6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=3, dflash_config={"block_size": 4, "mask_token_id": V - 1, "target_layer_ids": [1, 4]},
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    cfg.update(overrides)
    return DraftConfig.from_dict(cfg)


def randomized(config: DraftConfig, seed=0) -> DFlashDraft:
    draft = DFlashDraft(config)
    rng = np.random.default_rng(seed)
    def sample(value):  # norms near 1, matrices ~ N(0, 0.3)
        noise = rng.normal(0, 0.2 if value.ndim == 1 else 0.3, value.shape)
        return mx.array(noise + (value.ndim == 1), dtype=mx.float32)

    draft.load_weights([(k, sample(v)) for k, v in tree_flatten(draft.parameters())])
    return draft


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * freqs[None]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def reference_logits(draft: DFlashDraft, features, block_embeddings, embed):
    """Explicit non-cached attention over [context ; block] for every layer."""
    cfg = draft.config
    p = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(draft.parameters())}
    F = np.array(features, dtype=np.float64)[0]
    x = np.array(block_embeddings, dtype=np.float64)[0]
    P, b = F.shape[0], x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = rms(F @ p["fc.weight"].T, p["hidden_norm.weight"])
    ctx_pos, blk_pos = np.arange(P, dtype=np.float64), np.arange(P, P + b, dtype=np.float64)
    h = x
    for i, kind in enumerate(cfg.layer_types):
        w = lambda n: p[f"layers.{i}.{n}"]
        xn = rms(h, w("input_layernorm.weight"))
        q = rope(rms((xn @ w("self_attn.q_proj.weight").T).reshape(b, nh, hd), w("self_attn.q_norm.weight")), blk_pos, cfg.rope_theta)

        def kv(src, pos):
            k = (src @ w("self_attn.k_proj.weight").T).reshape(len(src), nkv, hd)
            k = rope(rms(k, w("self_attn.k_norm.weight")), pos, cfg.rope_theta)
            return k, (src @ w("self_attn.v_proj.weight").T).reshape(len(src), nkv, hd)

        kc, vc = kv(ctx, ctx_pos)
        kb, vb = kv(xn, blk_pos)
        K, Vv = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        K, Vv = np.repeat(K, nh // nkv, axis=1), np.repeat(Vv, nh // nkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, K) / np.sqrt(hd)
        # the reference's mask: a query at t keeps key s with t - s < window
        # (sliding layers) and s <= t (causal layers)
        t, key = blk_pos[:, None], np.concatenate([ctx_pos, blk_pos])[None, :]
        keep = np.ones((b, P + b), dtype=bool)
        if kind == "sliding_attention":
            keep &= t - key < cfg.sliding_window
        if cfg.causal(kind):
            keep &= key <= t
        scores = np.where(keep[None], scores, -np.inf)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", attn, Vv).reshape(b, nh * hd)
        h = h + out @ w("self_attn.o_proj.weight").T
        hn = rms(h, w("post_attention_layernorm.weight"))
        g, u = hn @ w("mlp.gate_proj.weight").T, hn @ w("mlp.up_proj.weight").T
        h = h + (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj.weight").T
    h = rms(h, p["norm.weight"])
    return h @ np.array(embed, dtype=np.float64).T


@pytest.mark.parametrize("context", [1, 3, 9])
def test_block_logits_match_the_dflash_equations(context):
    """With a window of 3 and a block of 4, context 9 leaves every block query a
    different set of context keys (t - s < 3): the per-query rule is exercised."""
    draft = randomized(small_config())
    rng = np.random.default_rng(1)
    features = mx.array(rng.normal(size=(1, context, 2 * H)), dtype=mx.float32)
    embed = mx.array(rng.normal(size=(V, H)), dtype=mx.float32)
    block = mx.array([[5] + [V - 1] * 3])
    cache = draft.make_cache()
    draft.inject(features[:, :1], cache)  # injection in chunks, as the loop does
    if context > 1:
        draft.inject(features[:, 1:], cache)
    hidden = draft(embed[block], cache)
    got = np.array(hidden @ embed.T)[0]
    want = reference_logits(draft, features, embed[block], embed)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert [c.offset for c in cache] == [context] * 3  # the block was not kept
    again = draft(embed[block], cache)
    assert mx.array_equal(again, hidden)


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_causal_block_attention_follows_layer_type_or_explicit_is_causal(is_causal):
    """By default sliding layers are causal inside the block and full layers are
    not (z-lab's reference); an explicit ``is_causal`` sets every layer."""
    config = small_config(**({} if is_causal is None else {"is_causal": is_causal}))
    want = [kind == "sliding_attention" if is_causal is None else is_causal for kind in config.layer_types]
    draft = randomized(config)
    assert [layer.self_attn.causal for layer in draft.layers] == want
    assert config.to_dict().get("is_causal") == is_causal
    rng = np.random.default_rng(3)
    features = mx.array(rng.normal(size=(1, 5, 2 * H)), dtype=mx.float32)
    embed = mx.array(rng.normal(size=(V, H)), dtype=mx.float32)
    block = mx.array([[5, V - 1, V - 1, V - 1]])
    cache = draft.make_cache()
    draft.inject(features, cache)
    got = np.array(draft(embed[block], cache) @ embed.T)[0]
    np.testing.assert_allclose(got, reference_logits(draft, features, embed[block], embed), rtol=1e-4, atol=1e-4)
    # a causal draft's first position cannot see the later ones: changing them leaves it alone
    other = draft(embed[mx.array([[5, 7, 8, 9]])], cache)
    first_same = mx.allclose(other[:, 0], draft(embed[block], cache)[:, 0], atol=1e-6).item()
    assert first_same == all(want)


@pytest.mark.parametrize("window", [2, 5, 6, 40])
@pytest.mark.parametrize("is_causal", [None, False])
def test_sliding_window_is_per_query(window, is_causal):
    """Block position i (absolute p + i) sees context positions p+i-W+1..p-1:
    a later query sees fewer context positions, never more than W - 1 - i.
    Windows below, at and above the block and the context length."""
    draft = randomized(small_config(sliding_window=window, layer_types=["sliding_attention"] * 3,
                                    **({} if is_causal is None else {"is_causal": is_causal})))
    rng = np.random.default_rng(window)
    features = mx.array(rng.normal(size=(1, 11, 2 * H)), dtype=mx.float32)
    embed = mx.array(rng.normal(size=(V, H)), dtype=mx.float32)
    block = mx.array([[5, V - 1, V - 1, V - 1]])
    cache = draft.make_cache()
    draft.inject(features[:, :4], cache)
    draft.inject(features[:, 4:], cache)
    got = np.array(draft(embed[block], cache) @ embed.T)[0]
    np.testing.assert_allclose(got, reference_logits(draft, features, embed[block], embed), rtol=1e-4, atol=1e-4)


def test_training_mask_is_the_drafts_rule():
    """The training forward sees, per block query, the same context as the draft."""
    from dflash_mlx.train.objective import context_mask

    anchors = mx.array([[6, 2]])
    mask = np.array(context_mask(anchors, 10, 4, window=3))  # [1, 2, 4, 10]
    for j, a in enumerate([6, 2]):
        for i in range(4):
            want = [(s < a) and (a + i - s < 3) for s in range(10)]
            assert mask[0, j, i].tolist() == want


def test_sliding_window_changes_what_the_block_sees():
    """A sliding layer must ignore context older than its window."""
    rng = np.random.default_rng(2)
    features = mx.array(rng.normal(size=(1, 8, 2 * H)), dtype=mx.float32)
    embed = mx.array(rng.normal(size=(V, H)), dtype=mx.float32)
    sliding = randomized(small_config(layer_types=["sliding_attention"] * 3))
    full = randomized(small_config(layer_types=["full_attention"] * 3))
    outs = []
    for draft in (sliding, full):
        cache = draft.make_cache()
        draft.inject(features, cache)
        outs.append(draft(embed[mx.array([[3, V - 1]])], cache))
    assert not mx.allclose(outs[0], outs[1], atol=1e-3)


NEWER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2560,
    "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 9216, "vocab_size": 248320, "rms_norm_eps": 1e-6, "num_target_layers": 32,
    "tie_word_embeddings": True, "max_position_embeddings": 262144,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 4096,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 7, 13, 19, 25, 29]},
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
}
OLDER = {
    k: v for k, v in NEWER.items() if k not in ("dflash_config", "rope_parameters")
} | {
    "block_size": 16, "rope_theta": 10000000, "rope_scaling": None,
    "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 7, 13, 19, 25, 29]},
}


@pytest.mark.parametrize("raw", [NEWER, OLDER], ids=["newer", "older"])
def test_both_dialects_parse_to_the_same_config(raw):
    cfg = DraftConfig.from_dict(json.loads(json.dumps(raw)))
    assert (cfg.block_size, cfg.mask_token_id, cfg.rope_theta) == (16, 248077, 1e7)
    assert cfg.target_layer_ids == [1, 7, 13, 19, 25, 29]
    assert cfg.layer_types[:5] == ["sliding_attention"] * 5 and cfg.sliding_window == 4096
    assert cfg.feature_size == 6 * 2560
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg  # converted drafts round-trip


def test_published_size_draft_is_built_without_allocating_weights():
    before = mx.get_active_memory()
    draft = DFlashDraft(DraftConfig.from_dict(NEWER))
    shapes = {k: v.shape for k, v in tree_flatten(draft.parameters())}
    assert len(shapes) == 6 * 11 + 3
    assert shapes["fc.weight"] == (2560, 6 * 2560)
    assert shapes["layers.5.self_attn.k_proj.weight"] == (8 * 128, 2560)
    assert shapes["layers.0.mlp.down_proj.weight"] == (2560, 9216)
    assert mx.get_active_memory() - before < 16 * 2**20  # lazy: ~1 GB if materialized


def test_missing_target_layer_ids_use_the_published_default():
    raw = json.loads(json.dumps(NEWER))
    del raw["dflash_config"]["target_layer_ids"]
    assert DraftConfig.from_dict(raw).target_layer_ids == [1, 7, 12, 18, 23, 29]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.pop("sliding_window"), "sliding_window"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    raw = json.loads(json.dumps(NEWER))
    change(raw)
    with pytest.raises(DFlashError, match=message):
        DraftConfig.from_dict(raw)
