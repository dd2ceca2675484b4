"""Fidelity to the equations (docs/dflash2.md): a DFlash2 draft written in
z-lab's tensor layout gives the block logits, greedy selector paths and T > 0
q rows of a float64 NumPy reference written from the equations alone, with
output_multiplier and softcap, is_causal absent, true and false, and a
sliding window shorter than the context. The same reference without the
convolutions checks the v1 draft's masks (sliding layers without is_causal
are causal inside the block)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from checkpoints import write_dflash2_draft, write_draft
from dflash_mlx import Target, load_draft
from dflash_mlx.loop.decoder import DFlash2Proposer, DraftProposer
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams

BLOCK, CONTEXT, WINDOW = 4, 12, 6  # block row i sees the last WINDOW - 1 - i of 12 context rows
SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    "published: all sliding, is_causal false, multiplier and softcap": dict(
        layer_types=[SLIDING] * 2, is_causal=False, output_multiplier=0.5, softcap=2.0),
    "is_causal absent: sliding causal, full bidirectional": dict(layer_types=[SLIDING, FULL], is_causal=None),
    "is_causal true, multiplier only": dict(layer_types=[FULL, SLIDING], is_causal=True, output_multiplier=1.7),
    "input_embedding_scale": dict(layer_types=[SLIDING, SLIDING], is_causal=False, input_embedding_scale=0.7),
    "three conv taps": dict(layer_types=[SLIDING, FULL], is_causal=False, kernel_size=3),
}


# ------------------------------------------------------------------ the reference, float64
def rms(x, w, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """Non-traditional RoPE of x [T, heads, D] at absolute positions [T]."""
    D = x.shape[-1]
    angles = (positions[:, None] * theta ** (-np.arange(0, D, 2) / D))[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def conv(x, base, dynamic, gs):
    """sum_o (B[o, c] + D[t, o, c // gs]) x[t - o, c], zero before row 0."""
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = np.zeros_like(x)
        shifted[o:] = x[: len(x) - o]
        out += (base[o] + np.repeat(dynamic[:, o], gs, axis=-1)) * shifted
    return out


def attention(x, ctx, W, prefix, cfg, layer_type, is_causal, window):
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_parameters"]["rope_theta"]
    b, p = len(x), len(ctx)
    positions = np.arange(p + b)
    q = rope(rms((x @ W[prefix + "q_proj.weight"].T).reshape(b, nh, hd), W[prefix + "q_norm.weight"]), positions[p:], theta)
    src = np.concatenate([ctx, x])
    k = rope(rms((src @ W[prefix + "k_proj.weight"].T).reshape(p + b, nkv, hd), W[prefix + "k_norm.weight"]), positions, theta)
    v = (src @ W[prefix + "v_proj.weight"].T).reshape(p + b, nkv, hd)
    causal = (layer_type == SLIDING) if is_causal is None else is_causal
    sees = np.ones((b, p + b), dtype=bool)
    for i in range(b):
        for s in range(p + b):
            if s < p:  # context row s: inside the window of query p + i
                sees[i, s] = layer_type != SLIDING or window is None or (p + i) - s < window
            else:  # block row s - p
                sees[i, s] = not causal or s - p <= i
    out = np.zeros((b, nh, hd))
    for h in range(nh):
        g = h // (nh // nkv)
        scores = np.where(sees, q[:, h] @ k[:, g].T * hd**-0.5, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (w / w.sum(-1, keepdims=True)) @ v[:, g]
    return out.reshape(b, nh * hd) @ W[prefix + "o_proj.weight"].T


def reference(W, cfg, embed, head, features, y, is_causal="config", window="config"):
    """(normed hidden [b-1, H], scaled logits [b-1, V]) of block rows 1..b-1."""
    dflash = cfg["dflash_config"]
    is_causal = cfg.get("is_causal") if is_causal == "config" else is_causal
    window = cfg.get("sliding_window") if window == "config" else window
    b, H = dflash["block_size"], cfg["hidden_size"]
    gs, K = dflash.get("conv_group_size", H), dflash.get("conv_kernel_size", 1)
    ctx = rms(features @ W["fc.weight"].T, W["hidden_norm.weight"])
    h = embed[[y] + [dflash["mask_token_id"]] * (b - 1)] * dflash.get("input_embedding_scale", 1.0)

    def wrapped(name, u, sublayer):  # conv(sublayer(conv(u; B0, Dpre)); B1, Dpost); identity for v1
        if name + ".base_kernel" not in W:
            return sublayer(u)
        dynamic = (u @ W[name + ".kernel_projection.weight"].T).reshape(b, 2, K, H // gs)
        base = W[name + ".base_kernel"]
        return conv(sublayer(conv(u, base[0], dynamic[:, 0], gs)), base[1], dynamic[:, 1], gs)

    for i, layer_type in enumerate(cfg.get("layer_types") or [FULL] * cfg["num_hidden_layers"]):
        L = f"layers.{i}."
        attend = lambda x: attention(x, ctx, W, L + "self_attn.", cfg, layer_type, is_causal, window)
        h = h + wrapped(L + "attention_conv", rms(h, W[L + "input_layernorm.weight"]), attend)
        mlp = lambda x: (lambda g: g / (1 + np.exp(-g)))(x @ W[L + "mlp.gate_proj.weight"].T) \
            * (x @ W[L + "mlp.up_proj.weight"].T) @ W[L + "mlp.down_proj.weight"].T
        h = h + wrapped(L + "mlp_conv", rms(h, W[L + "post_attention_layernorm.weight"]), mlp)
    hidden = rms(h, W["norm.weight"])[1:]
    z = hidden @ head.T * dflash.get("output_multiplier", 1.0)
    cap = dflash.get("final_logit_softcapping")
    return hidden, (cap * np.tanh(z / cap) if cap else z)


def selector_scores(W, k, hidden, z, j, prev):
    """(C_j, s_j over C_j): z_j(c) + sum_r P[prev, r] e_j[r] S[c, r]."""
    C = np.argsort(-z[j], kind="stable")[:k]
    e = W["candidate_selector.hidden_projection.weight"] @ hidden[j]
    P, S = W["candidate_selector.predecessor_codebook"], W["candidate_selector.successor_codebook"]
    return C, z[j, C] + (P[prev] * e) @ S[C].T


def greedy_path(W, k, hidden, z, y):
    path, prev = [], y
    for j in range(len(z)):
        C, s = selector_scores(W, k, hidden, z, j, prev)
        prev = int(C[np.argmax(s)])
        path.append(prev)
    return path


def q_rows(W, k, hidden, z, y, path, T):
    """q_j = softmax(s_j / T) over C_j along the given path, 0 elsewhere."""
    rows = np.zeros(z.shape)
    for j in range(len(z)):
        C, s = selector_scores(W, k, hidden, z, j, y if j == 0 else path[j - 1])
        w = np.exp((s - s.max()) / T)
        rows[j, C] = w / w.sum()
    return rows


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def target(target_dirs):
    """The llama target (an untied head) and its embedding and head in float64."""
    model, _ = mlx_lm_load(str(target_dirs["llama"]))
    config = json.loads((target_dirs["llama"] / "config.json").read_text())
    as64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)
    return Target(model), config, as64(model.model.embed_tokens.weight), as64(model.lm_head.weight)


def published_layout(path):
    """The draft's tensors as stored (z-lab's names: codebooks without .weight), in float64."""
    return {k: np.array(v, dtype=np.float64) for k, v in mx.load(str(path / "model.safetensors")).items()}


def features_and_anchor(config, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (CONTEXT, 2 * config["hidden_size"])), int(rng.integers(10, 400))


def run_ours(proposer, features, y):
    """Our scaled logits after injecting the context in two chunks."""
    proposer.observe(mx.array(features[None, :7], dtype=mx.float32), None)
    proposer.observe(mx.array(features[None, 7:], dtype=mx.float32), None)
    return np.array(proposer.propose(mx.array([y]), BLOCK), dtype=np.float64)


def close(got, want, tol=2e-4):
    return np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1.0)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_paths_and_q_rows_follow_the_equations(tmp_path, target, case):
    model_target, config, embed, head = target
    options = dict(CASES[case])
    scale = options.pop("input_embedding_scale", None)
    cfg = write_dflash2_draft(tmp_path, config, block_size=BLOCK, sliding_window=WINDOW, top_k=6,
                              codebook_std=1.0, seed=len(case), **options)
    if scale is not None:
        cfg["dflash_config"]["input_embedding_scale"] = scale
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    W, k = published_layout(tmp_path), cfg["dflash_config"]["selector_top_k"]
    draft = load_draft(str(tmp_path))
    assert draft.config.block_size == BLOCK
    blocks = []  # each seed's (hidden, logits), anchor and greedy path: walked together below
    for seed in range(3):
        features, y = features_and_anchor(config, seed)
        proposer = DFlash2Proposer(draft, model_target)
        z = run_ours(proposer, features, y)
        hidden, want = reference(W, cfg, embed, head, features, y)
        assert close(z, want), f"block logits differ by {np.abs(z - want).max():.2e}"
        path, q = proposer.draft_block(mx.array([y]), BLOCK, BlockSampler(SamplingParams()))
        assert q is None and path.tolist() == greedy_path(W, k, hidden, want, y)
        blocks.append((proposer._rows(mx.array([y]), BLOCK), y, path.tolist()))
        for draw in range(8):  # sampled paths: each row's q follows the token drawn before it
            sampler = BlockSampler(SamplingParams(temperature=1.5, seed=draw))
            path, q = proposer.draft_block(mx.array([y]), BLOCK, sampler)
            q_want = q_rows(W, k, hidden, want, y, path.tolist(), 1.5)
            q = np.exp(np.array(q, dtype=np.float64))
            assert np.array_equal(q > 0, q_want > 0), "q is not zero exactly outside the candidates"
            assert np.abs(q - q_want).max() < 1e-4
            assert all(q_want[j, d] > 0 for j, d in enumerate(path.tolist()))
    walked = draft.candidate_selector.greedy_walk(  # a batch's rows at T = 0: each block's walk, as alone
        mx.stack([h for (h, _), _, _ in blocks]), mx.stack([z for (_, z), _, _ in blocks]),
        mx.array([y for _, y, _ in blocks]))
    assert walked.tolist() == [path for _, _, path in blocks]


def test_the_fixtures_tell_the_variants_apart(tmp_path, target):
    """Each setting the test above covers changes the reference's output on
    its fixture, so matching the reference means getting each one right."""
    _, config, embed, head = target
    features, y = features_and_anchor(config, 0)
    cfg = write_dflash2_draft(tmp_path, config, block_size=BLOCK, sliding_window=WINDOW, top_k=6,
                              codebook_std=1.0, **CASES["is_causal absent: sliding causal, full bidirectional"])
    W = published_layout(tmp_path)
    hidden, z = reference(W, cfg, embed, head, features, y)
    for variant in (dict(is_causal=False), dict(is_causal=True), dict(window=None)):
        assert not close(reference(W, cfg, embed, head, features, y, **variant)[1], z, 1e-3), variant
    no_conv = {n: w for n, w in W.items() if "_conv." not in n}
    assert not close(reference(no_conv, cfg, embed, head, features, y)[1], z, 1e-3)
    paths = [greedy_path(W, 6, hidden, z, prev) for prev in range(10, 40)]
    assert any(p != np.argmax(z, axis=-1).tolist() for p in paths), "the transition never changes a path"


@pytest.mark.parametrize("scaling", [{}, dict(output_multiplier=0.5, final_logit_softcapping=2.0,
                                               input_embedding_scale=1.3)])
def test_v1_drafts_follow_the_newer_code(tmp_path, target, scaling):
    """z-lab's newer code: a sliding layer is causal inside the block unless
    is_causal says otherwise, full layers are not; logits are scaled and
    capped, and the block embedding scaled, as for DFlash2. Our v1 draft does
    the same."""
    model_target, config, embed, head = target
    cfg = write_draft(tmp_path, config, block_size=BLOCK, layer_types=[SLIDING, FULL], sliding_window=WINDOW)
    cfg["dflash_config"].update(scaling)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    W = published_layout(tmp_path)
    draft = load_draft(str(tmp_path))
    assert draft.config.is_causal is None
    features, y = features_and_anchor(config, 1)
    z = run_ours(DraftProposer(draft, model_target), features, y)
    want = reference(W, cfg, embed, head, features, y)[1]
    assert close(z, want)
    assert not close(reference(W, cfg, embed, head, features, y, is_causal=False)[1], want, 1e-3)
