"""Gemma 4's DSpark packaging (``Gemma4DSparkModel``): a copy of Gemma 4's text
config with DeepSpec's keys and Gemma 4's layer (the head width
``global_head_dim``, K = V through a weightless norm, attention scale 1, the
full-attention layers' partial proportional RoPE, sandwich norms and
``layer_scalar``). It loads, matches a float64 NumPy version of those
equations (which mutated versions do not), converts, and stays mlx-lm's greedy
output at every acceptance length, on the K = V target (``gemma4_text``) and
on the one with per-layer inputs and a ``v_proj`` (``gemma4``)."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_dspark import GAMMA, assert_every_acceptance_length, greedy_reference, markov_walk, rms
from test_dspark_packaging import draft_rows

from checkpoints import text_config
from dflash_mlx import generate, load, load_draft
from dflash_mlx.convert import convert_draft
from dflash_mlx.draft import DSparkConfig, DSparkDraft
from dflash_mlx.loop.sampling import SamplingParams

# Gemma 4's values are normed: the draft's KV injection runs layer by layer, and says so once
pytestmark = pytest.mark.filterwarnings("ignore:dflash-mlx. KV injection runs layer by layer")

PROMPTS = {"gemma4_text": "write a short story about a cat who", "gemma4": "the quick brown fox"}  # not degenerate
FULL_ROPE = {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"}
RANK = 8


def write_gemma4_dspark_draft(path, model, config, seed=0):
    """A DSpark draft for the Gemma 4 target ``model`` in DeepSpec's Gemma 4
    layout: the target's text config with DeepSpec's keys, Gemma 4 layer
    tensors under their checkpoint names, copies of the target's embedding and
    head. Returns the config."""
    text = copy.deepcopy(text_config(config))
    L, V, H, I = text["num_hidden_layers"], text["vocab_size"], text["hidden_size"], text["intermediate_size"]
    k_eq_v = bool(text.get("attention_k_eq_v"))
    nh, d = text["num_attention_heads"], text["global_head_dim"]
    nkv = text["num_global_key_value_heads"] if k_eq_v else text["num_key_value_heads"]
    ids, layers = [1, L - 2], 2
    cfg = {**text, "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", "num_target_layers": L,
           "num_hidden_layers": layers, "block_size": GAMMA, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * layers, "mask_token_id": V - 1, "target_layer_ids": ids,
           "num_anchors": 512, "enable_confidence_head": True, "confidence_head_with_markov": True,
           "markov_rank": RANK, "markov_head_type": "vanilla", "attention_k_eq_v": k_eq_v,
           "rope_parameters": {"full_attention": FULL_ROPE,
                               "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}
    rng = np.random.default_rng(seed)
    linear = lambda out, inp: mx.array(rng.normal(0.0, inp**-0.5, (out, inp)).astype(np.float32))
    norm = lambda n: mx.array((1.0 + rng.normal(0.0, 0.2, n)).astype(np.float32))
    weights = {"fc.weight": linear(H, len(ids) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(layers):
        shapes = {"self_attn.q_proj": (nh * d, H), "self_attn.k_proj": (nkv * d, H), "self_attn.o_proj": (H, nh * d),
                  "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
        if not k_eq_v:
            shapes["self_attn.v_proj"] = (nkv * d, H)
        weights.update({f"layers.{i}.{name}.weight": linear(*shape) for name, shape in shapes.items()})
        for name, n in (("self_attn.q_norm", d), ("self_attn.k_norm", d), ("input_layernorm", H),
                        ("post_attention_layernorm", H), ("pre_feedforward_layernorm", H),
                        ("post_feedforward_layernorm", H)):
            weights[f"layers.{i}.{name}.weight"] = norm(n)
        weights[f"layers.{i}.layer_scalar"] = mx.array([0.6 + 0.1 * i], dtype=mx.float32)
    target = dict(tree_flatten(model.parameters()))
    embed = next(w for name, w in target.items() if name.endswith("embed_tokens.weight"))
    weights.update({"embed_tokens.weight": embed, "lm_head.weight": embed,
                    "markov_head.markov_w1.weight": linear(V, RANK) * RANK**0.5,
                    "markov_head.markov_w2.weight": linear(V, RANK),
                    "confidence_head.proj.weight": linear(1, H + RANK), "confidence_head.proj.bias": linear(1, 1)[0]})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, target_dirs):
    """family -> (mlx-lm model, tokenizer, Gemma 4 DSpark draft directory)."""
    out = {}
    for family in ("gemma4_text", "gemma4"):
        model, tokenizer = load(str(target_dirs[family]))
        path = tmp_path_factory.mktemp(f"dspark-{family}")
        write_gemma4_dspark_draft(path, model, json.loads((target_dirs[family] / "config.json").read_text()))
        out[family] = (model, tokenizer, path)
    return out


# ---------------------------------------------------------------- the float64 reference

def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def partial_rope(x, positions, theta, rotated):
    """Gemma 4's proportional RoPE of x [T, heads, d]: split-half pairs (i, i + d/2),
    pair i turned by position * theta^(-2i/d) for the first rotated/2 pairs, the rest not."""
    d = x.shape[-1]
    i = np.arange(d // 2)
    angles = positions[:, None] * np.where(i < rotated // 2, theta ** (-2.0 * i / d), 0.0)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference(w, cfg, features, anchor, scale=1.0, v_norm=True, layer_scalar=True, rotated=None):
    """(U, greedy drafts, c) of the Gemma 4 DSpark equations in float64; the
    keywords mutate them (an attention scale, V normed like K, no layer scalar,
    the whole head rotated)."""
    T, gamma, H = features.shape[0], cfg["block_size"], cfg["hidden_size"]
    nh, d, k_eq_v = cfg["num_attention_heads"], cfg["global_head_dim"], cfg["attention_k_eq_v"]
    nkv = cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]
    rope = cfg["rope_parameters"]["full_attention"]
    rotated = int(d * rope["partial_rotary_factor"]) if rotated is None else rotated
    ids = [anchor] + [cfg["mask_token_id"]] * (gamma - 1)
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = w["embed_tokens.weight"][ids] * np.sqrt(H)
    pos_ctx, pos_blk = np.arange(T), T + np.arange(len(ids))
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"layers.{i}.{name}"]
        h = rms(x, p("input_layernorm.weight"))
        heads = lambda y, proj, n: (y @ p(f"self_attn.{proj}.weight").T).reshape(len(y), n, d)
        q = partial_rope(rms(heads(h, "q_proj", nh), p("self_attn.q_norm.weight")), pos_blk, rope["rope_theta"], rotated)
        keys, values = [], []
        for src, pos in ((ctx, pos_ctx), (h, pos_blk)):
            raw = heads(src, "k_proj", nkv)
            keys.append(partial_rope(rms(raw, p("self_attn.k_norm.weight")), pos, rope["rope_theta"], rotated))
            v = raw if k_eq_v else heads(src, "v_proj", nkv)
            values.append(rms(v, 1.0) if v_norm else rms(v, p("self_attn.k_norm.weight")))
        k, v = np.concatenate(keys), np.concatenate(values)
        out = np.empty_like(q)
        for j in range(nh):
            s = q[:, j] @ k[:, j * nkv // nh].T * scale
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (a / a.sum(-1, keepdims=True)) @ v[:, j * nkv // nh]
        x = x + rms(out.reshape(len(ids), -1) @ p("self_attn.o_proj.weight").T, p("post_attention_layernorm.weight"))
        h = rms(x, p("pre_feedforward_layernorm.weight"))
        mlp = (gelu_tanh(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        x = x + rms(mlp, p("post_feedforward_layernorm.weight"))
        x = x * (p("layer_scalar")[0] if layer_scalar else 1.0)
    hidden = rms(x, w["norm.weight"])
    cap = cfg["final_logit_softcapping"]
    return markov_walk(w, hidden, cap * np.tanh(hidden @ w["lm_head.weight"].T / cap), anchor, gamma)


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_the_draft_follows_the_gemma4_dspark_equations(pairs, family):
    """Base logits of every slot, the greedy Markov walk and the confidences
    match the float64 reference; each mutation (attention scaled by 1/sqrt(d),
    V normed with K's weight, no layer scalar, RoPE over the whole head) is told
    apart, so the comparison has power."""
    model, tokenizer, path = pairs[family]
    cfg = json.loads((path / "config.json").read_text())
    w = {name: np.array(a.astype(mx.float32), dtype=np.float64) for name, a in mx.load(str(path / "model.safetensors")).items()}
    draft = load_draft(str(path), dtype="float32")
    U, drafts, c, _, features, anchor = draft_rows(draft, model, tokenizer, cfg)

    def agrees(ref):
        return np.allclose(U, ref[0], rtol=1e-3, atol=1e-3), drafts == ref[1], np.allclose(c, ref[2], atol=1e-4)

    assert agrees(reference(w, cfg, features, anchor)) == (True, True, True)
    d = cfg["global_head_dim"]
    for mutation in ({"scale": d**-0.5}, {"v_norm": False}, {"layer_scalar": False}, {"rotated": d}):
        assert not agrees(reference(w, cfg, features, anchor, **mutation))[0], mutation

    # at T > 0, q_k is the log-softmax of z_k / T (the capped U plus the Markov term) after the drafts drawn
    U, drafts, _, q, _, anchor = draft_rows(draft, model, tokenizer, cfg, SamplingParams(temperature=0.8, seed=2))
    previous = [anchor] + drafts[:-1]
    z = (U + w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T) / 0.8
    assert np.allclose(np.array(q, dtype=np.float64), z - np.log(np.exp(z).sum(-1, keepdims=True)), atol=1e-3)


def test_gemma4s_layout_loads_as_its_own_layer(pairs):
    path = pairs["gemma4_text"][2]
    draft = load_draft(str(path))
    assert isinstance(draft, DSparkDraft) and draft.config.block_size == GAMMA + 1
    attn = draft.layers[0].self_attn
    assert "v_proj" not in attn and attn.n_kv_heads == 1 and attn.head_dim == 32 and attn.scale == 1.0
    names = {name for name, _ in tree_flatten(draft.parameters())}
    assert "layers.1.layer_scalar" in names and "layers.0.pre_feedforward_layernorm.weight" in names
    again = draft.config.to_dict()  # Gemma 4's layout back
    assert again["architectures"] == ["Gemma4DSparkModel"] and again["block_size"] == GAMMA
    assert DSparkConfig.from_dict(again) == draft.config
    with_v = load_draft(str(pairs["gemma4"][2])).layers[0].self_attn
    assert "v_proj" in with_v and with_v.n_kv_heads == 2


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_greedy_output_is_mlx_lm_greedy_output(pairs, family):
    model, tokenizer, path = pairs[family]
    draft = load_draft(str(path))
    ids = tokenizer.encode(PROMPTS[family])
    want = greedy_reference(model, ids, 24)
    assert len(set(want)) > 8, "fixture too degenerate to prove anything"
    for block_size in (2, GAMMA + 1):
        assert generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size).tokens == want


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_every_acceptance_length_stays_lossless(pairs, family):
    model, tokenizer, path = pairs[family]
    assert_every_acceptance_length(model, tokenizer, path)


def test_it_converts_and_quantizes_in_its_own_layout(pairs, tmp_path):
    model, tokenizer, path = pairs["gemma4_text"]
    out = convert_draft(str(path), tmp_path / "q8", bits=8, group_size=32, log=print)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4DSparkModel"] and cfg["quantization"]["bits"] == 8
    converted = load_draft(str(out))
    assert converted.layers[0].self_attn.k_proj.bits == 8
    ids = tokenizer.encode(PROMPTS["gemma4_text"])
    got = generate(model, converted, tokenizer, ids, max_tokens=16, block_size=GAMMA + 1).tokens
    assert got == greedy_reference(model, ids, 16)
