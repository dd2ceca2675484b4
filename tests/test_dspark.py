"""DSpark drafts load in DeepSpec's on-disk layout (``Qwen3DSparkModel``, every
field required), refuse a wrong layout in one line, match a float64 NumPy
version of the DSpark equations (which mutated versions do not), never draft
wider than the trained block, and stay token-identical to mlx-lm's greedy
output at every acceptance length."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from checkpoints import text_config, write_draft
from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.draft import DSparkConfig, DSparkDraft
from dflash_mlx.loop.decoder import DSparkProposer, SpeculativeDecoder
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams
from dflash_mlx.tree import TreeDecoder

FAMILIES = ["llama", "qwen3", "qwen3_5"]
GAMMA = 5  # the trained block: 5 drafts, a verified width of 6


def write_dspark_draft(path, model, config, *, gamma=GAMMA, rank=8, markov_std=1.0, confidence=True,
                       with_markov=True, target_layer_ids=None, seed=0):
    """A DSpark draft for the mlx-lm target ``model`` (its ``config``) in DeepSpec's
    layout: a copy of the target's text config with DeepSpec's keys, flat
    tensor names, and copies of the target's embedding and head. Returns the config."""
    text = text_config(config)
    L, V, H = text["num_hidden_layers"], text["vocab_size"], text["hidden_size"]
    ids = target_layer_ids or [1, L - 2]
    write_draft(path, config, num_layers=2, target_layer_ids=ids, seed=seed)  # the v1 backbone's tensors
    cfg = {**copy.deepcopy(text), "architectures": ["Qwen3DSparkModel"], "num_target_layers": L,
           "num_hidden_layers": 2, "block_size": gamma, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * 2, "mask_token_id": V - 1, "target_layer_ids": ids,
           "num_anchors": 512, "enable_confidence_head": confidence, "markov_rank": rank}
    if rank:
        cfg["markov_head_type"] = "vanilla"
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov
    weights = dict(mx.load(str(path / "model.safetensors")))
    target = dict(tree_flatten(model.parameters()))
    embed = next(w for name, w in target.items() if name.endswith("embed_tokens.weight"))
    weights["embed_tokens.weight"] = embed
    weights["lm_head.weight"] = next((w for name, w in target.items() if name.endswith("lm_head.weight")), embed)
    rng = np.random.default_rng(seed + 1)
    normal = lambda std, *shape: mx.array(rng.normal(0.0, std, shape).astype(np.float32))
    if rank:
        weights["markov_head.markov_w1.weight"] = normal(markov_std, V, rank)
        weights["markov_head.markov_w2.weight"] = normal(markov_std / rank**0.5, V, rank)
    if confidence:
        weights["confidence_head.proj.weight"] = normal(0.3, 1, H + (rank if with_markov else 0))
        weights["confidence_head.proj.bias"] = normal(0.3, 1)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, target_dirs):
    """family -> (mlx-lm model, tokenizer, DSpark draft directory, the target's config)."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        path = tmp_path_factory.mktemp(f"dspark-{family}")
        config = json.loads((target_dirs[family] / "config.json").read_text())
        write_dspark_draft(path, model, config)
        out[family] = (model, tokenizer, path, config)
    return out


def greedy_reference(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def with_config(tmp_path, source, name, edit):
    """A copy of the draft at ``source`` (its weights linked) whose config ``edit`` changed."""
    path = tmp_path / name
    path.mkdir()
    (path / "model.safetensors").symlink_to(source / "model.safetensors")
    cfg = json.loads((source / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_deepspecs_layout_loads_as_dspark(loaded):
    path = loaded["qwen3"][2]
    draft = load_draft(str(path))
    assert isinstance(draft, DSparkDraft)
    assert draft.config.block_size == GAMMA + 1  # the verified width: the anchor and gamma drafts
    names = {name for name, _ in tree_flatten(draft.parameters())}
    assert not {n for n in names if n.startswith(("embed_tokens", "lm_head"))}  # the target's are borrowed
    stored = mx.load(str(path / "model.safetensors"))["markov_head.markov_w1.weight"]
    assert mx.array_equal(draft.markov_head.markov_w1.weight, stored).item()
    assert draft.confidence_head.proj.weight.shape == (1, 64 + 8)
    again = draft.config.to_dict()  # DeepSpec's layout back: the cost curve's cache key
    assert again["block_size"] == GAMMA and again["architectures"] == ["Qwen3DSparkModel"]
    assert DSparkConfig.from_dict(again) == draft.config


REQUIRED = ["block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors",
            "enable_confidence_head", "markov_rank", "markov_head_type", "confidence_head_with_markov"]


def test_every_missing_field_is_refused_in_one_line(loaded, tmp_path):
    path = loaded["qwen3"][2]
    for key in REQUIRED:
        broken = with_config(tmp_path, path, key, lambda cfg: cfg.pop(key))
        with pytest.raises(DFlashError, match=key) as e:
            load_draft(broken)
        assert "\n" not in str(e.value)


WRONG = {
    "sample_from_anchor": (lambda cfg: cfg.update(sample_from_anchor=False), "anchor-first"),
    "two block sizes": (lambda cfg: cfg.update(dflash_config={"block_size": GAMMA + 1}), "must match"),
    "gated head": (lambda cfg: cfg.update(markov_head_type="gated"), "vanilla"),
    "sliding layer": (lambda cfg: cfg.update(layer_types=["sliding_attention", "full_attention"],
                                             sliding_window=8), "no mask"),
    "embedding output": (lambda cfg: cfg.update(target_layer_ids=[-1, 3]), "embedding output"),
    "last layer": (lambda cfg: cfg.update(target_layer_ids=[1, 5]), "must increase"),
    "speculators eagle3": (lambda cfg: cfg.update(speculators_config={"algorithm": "eagle3"}), "not a DSpark draft"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_layout_is_refused_in_one_line(loaded, tmp_path, name):
    edit, message = WRONG[name]
    with pytest.raises(DFlashError, match=message) as e:
        load_draft(with_config(tmp_path, loaded["qwen3"][2], "wrong", edit))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the float64 reference

def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta, interleaved=False):
    """RoPE of x [T, heads, d] at absolute positions [T]: split-half pairs (i, i + d/2),
    or interleaved pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    angles = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2 :])
    if interleaved:
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference(w, cfg, features, anchor, slot0=True, markov=True, shift=0, cumulative=False, interleaved=False,
              kept=None):
    """(U [gamma, V], greedy drafts [gamma], c [gamma]) of DeepSpec's equations in
    float64 from the checkpoint's tensors ``w``; the keywords mutate them, or
    describe the packaging: interleaved RoPE, a reduced vocabulary (``kept``, the
    target ids W2's rows and the drafts cover; U is -inf elsewhere)."""
    T, gamma, theta = features.shape[0], cfg["block_size"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ids = [anchor] + [cfg["mask_token_id"]] * (gamma - 1 + (not slot0))
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = w["embed_tokens.weight"][ids]
    pos_ctx, pos_blk = np.arange(T), T + shift + np.arange(len(ids))
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"layers.{i}.{name}.weight"]
        h = rms(x, p("input_layernorm"))
        heads = lambda y, proj, n: (y @ p(f"self_attn.{proj}").T).reshape(len(y), n, d)
        q = rope(rms(heads(h, "q_proj", nh), p("self_attn.q_norm")), pos_blk, theta, interleaved)
        k = np.concatenate([rope(rms(heads(src, "k_proj", nkv), p("self_attn.k_norm")), pos, theta, interleaved)
                            for src, pos in ((ctx, pos_ctx), (h, pos_blk))])
        v = np.concatenate([heads(ctx, "v_proj", nkv), heads(h, "v_proj", nkv)])
        out = np.empty_like(q)
        for j in range(nh):
            s = q[:, j] @ k[:, j * nkv // nh].T / np.sqrt(d)
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (a / a.sum(-1, keepdims=True)) @ v[:, j * nkv // nh]
        x = x + out.reshape(len(ids), -1) @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"))
        gate = h @ p("mlp.gate_proj").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    hidden = rms(x, w["norm.weight"])[0 if slot0 else 1 :]
    return markov_walk(w, hidden, hidden @ w["lm_head.weight"].T, anchor, gamma, markov, cumulative, kept)


def markov_walk(w, hidden, U, anchor, gamma, markov=True, cumulative=False, kept=None):
    """(U, greedy drafts, c) of the Markov walk and the confidence head in float64
    from the slots' normed hidden states and base logits U (``reference``'s keywords)."""
    W1, W2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    if kept is not None:  # W2 has a row per kept id
        U = np.where(np.isin(np.arange(U.shape[-1]), kept), U, -np.inf)
        W2 = np.zeros((U.shape[-1], W2.shape[1]))
        W2[kept] = w["markov_head.markov_w2.weight"]
    previous, drafts, c = anchor, [], []
    for k in range(gamma):
        z = U[k] + (W2 @ W1[previous] if markov else 0.0)
        c.append(1 / (1 + np.exp(-(w["confidence_head.proj.weight"][0] @ np.concatenate([hidden[k], W1[previous]])
                                   + w["confidence_head.proj.bias"][0]))))
        previous = int(np.argmax(z))
        drafts.append(previous)
    return U, drafts, np.cumprod(c) if cumulative else np.array(c)


def test_the_draft_follows_the_dspark_equations(loaded):
    """Base logits of every slot (slot 0 included), the greedy Markov walk and
    the per-position confidences match the float64 reference; each mutation
    of the reference (slot 0 dropped, Markov term off, block RoPE one position
    late, cumulative confidences) is told apart, so the comparison has power."""
    model, tokenizer, path, _ = loaded["qwen3"]
    cfg = json.loads((path / "config.json").read_text())
    w = {name: np.array(a.astype(mx.float32), dtype=np.float64) for name, a in mx.load(str(path / "model.safetensors")).items()}
    draft, target = load_draft(str(path), dtype="float32"), Target(model)
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps"))
    out = target.forward(prompt[None], target.make_cache(), cfg["target_layer_ids"])
    anchor = mx.argmax(target.logits(out.hidden[:, -1]), axis=-1).astype(mx.int32)
    proposer = DSparkProposer(draft, target)
    proposer.observe(out.features, prompt)
    U = np.array(proposer.propose(anchor, GAMMA + 1), dtype=np.float64)
    drafted, q = proposer.draft_block(anchor, GAMMA + 1, BlockSampler(SamplingParams()))
    ours = U, drafted.tolist(), np.array(proposer.confidence, dtype=np.float64)
    features = np.array(out.features[0], dtype=np.float64)

    def agrees(ref):
        return (np.allclose(ours[0], ref[0], rtol=1e-3, atol=1e-3), ours[1] == ref[1],
                np.allclose(ours[2], ref[2], atol=1e-4))

    assert q is None and agrees(reference(w, cfg, features, anchor.item())) == (True, True, True)
    assert not agrees(reference(w, cfg, features, anchor.item(), slot0=False))[0]
    assert not agrees(reference(w, cfg, features, anchor.item(), markov=False))[1]
    assert not agrees(reference(w, cfg, features, anchor.item(), shift=1))[0]
    assert not agrees(reference(w, cfg, features, anchor.item(), cumulative=True))[2]

    # at T > 0, q_k is the softmax of z_k / T after the drafts actually drawn
    drafted, q = proposer.draft_block(anchor, GAMMA + 1, BlockSampler(SamplingParams(temperature=0.7, seed=1)))
    previous = [anchor.item()] + drafted.tolist()[:-1]
    z = (ours[0] + w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T) / 0.7
    want = z - np.log(np.exp(z).sum(-1, keepdims=True))
    assert np.allclose(np.array(q, dtype=np.float64), want, atol=1e-3)

    # a batch's greedy rows walk at once (``greedy_walk``): each block's walk is its own
    blocks, anchors = [ours[0], ours[0][::-1], 0.5 * ours[0]], [anchor.item(), 7, 123]
    walked = draft.greedy_walk(mx.array(np.stack(blocks), dtype=mx.float32), mx.array(anchors))
    hidden = np.zeros((GAMMA, cfg["hidden_size"]))  # the confidences are not compared
    assert walked.tolist() == [markov_walk(w, hidden, U, a, GAMMA)[1] for U, a in zip(blocks, anchors)]


# ---------------------------------------------------------------- lossless and bounded

@pytest.mark.filterwarnings("ignore:block_size 12 is above")
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_mlx_lm_greedy_output(loaded, family):
    model, tokenizer, path, _ = loaded[family]
    draft = load_draft(str(path))
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 24)
    for block_size in (2, GAMMA + 1, 2 * GAMMA + 2):
        res = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size)
        assert res.tokens == want
        assert max(res.block_sizes) == min(block_size, GAMMA + 1)  # never wider than trained


def test_a_draft_without_heads_is_lossless_too(loaded, tmp_path):
    """markov_rank 0 and no confidence head: z_k = U_k, and no c_k."""
    model, tokenizer, _, config = loaded["qwen3"]
    path = tmp_path / "plain"
    write_dspark_draft(path, model, config, rank=0, confidence=False)
    draft = load_draft(str(path))
    assert draft.markov_head is None and draft.confidence_head is None
    ids = tokenizer.encode("hello world")
    assert generate(model, draft, tokenizer, ids, max_tokens=16, block_size=GAMMA + 1).tokens == \
        greedy_reference(model, ids, 16)


@pytest.mark.filterwarnings("ignore:block_size 12 is above")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_ddtree_from_the_markov_head_is_lossless(loaded, family):
    model, tokenizer, path, _ = loaded[family]
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 16)
    for block_size, budget in ((GAMMA + 1, 6), (2 * GAMMA + 2, 24)):
        res = generate(model, load_draft(str(path)), tokenizer, ids, max_tokens=16, block_size=block_size,
                       tree_budget=budget)
        assert res.tokens == want


def test_a_nodes_children_are_the_top_of_z_after_its_token(loaded, tmp_path):
    """Each node's children in the decoder's tree are the best candidates of
    z = U + W2 W1[the node's token] (the root's: the anchor) as the float64
    reference computes it; with a strong Markov head some differ from U's own."""
    model, tokenizer, _, config = loaded["qwen3"]
    path = tmp_path / "strong"
    cfg = write_dspark_draft(path, model, config, markov_std=4.0)
    w = {name: np.array(a.astype(mx.float32), dtype=np.float64) for name, a in mx.load(str(path / "model.safetensors")).items()}
    draft, target = load_draft(str(path), dtype="float32"), Target(model)
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps"))
    features = np.array(target.forward(prompt[None], target.make_cache(), cfg["target_layer_ids"]).features[0],
                        dtype=np.float64)
    decoder = TreeDecoder(target, DSparkProposer(draft, target), cfg["target_layer_ids"], GAMMA + 1, 16)
    anchor = decoder.prefill(prompt)
    tree = decoder.build(anchor, decoder.budget)
    U = reference(w, cfg, features, anchor)[0]
    W1, W2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    differ = 0
    for node, kids in enumerate(tree.children()):
        if kids:
            depth, n = tree.depths[node], len(kids)
            z = U[depth] + W2 @ W1[tree.tokens[node]]
            assert set(kids) == set(np.argsort(-z)[:n].tolist())
            differ += set(kids) != set(np.argsort(-U[depth])[:n].tolist())
    assert len(tree) == 17 and max(tree.depths) > 1 and differ


class SteeredProposer(DSparkProposer):
    """The real DSpark proposer and Markov walk, its base logits pushed towards
    the target's greedy continuation (corrupted at one slot), so every
    acceptance length happens."""

    def __init__(self, draft, target, prompt_len, continuation, corrupt_at):
        super().__init__(draft, target)
        self.position, self.prompt_len = 0, prompt_len
        self.continuation, self.corrupt_at = continuation, corrupt_at
        head = self.head
        self.head = lambda hidden: head(hidden) + self.push(hidden.shape[0], head(hidden).shape[-1])

    def observe(self, features, tokens):
        self.position += tokens.size
        super().observe(features, tokens)

    def push(self, n, vocab):
        start = self.position - self.prompt_len + 1
        tokens = list(self.continuation[start : start + n])
        if self.corrupt_at is not None:
            tokens[self.corrupt_at] = (tokens[self.corrupt_at] + 1) % vocab
        return (mx.arange(vocab)[None] == mx.array(tokens)[:, None]) * 1000.0


def assert_every_acceptance_length(model, tokenizer, path):
    """Steered to be right for its first a drafts, for every a up to the full block, the
    draft in ``path`` gives mlx-lm's greedy output, and its context holds committed positions only."""
    draft, target = load_draft(str(path)), Target(model)
    gamma = draft.config.block_size - 1
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 3 * gamma + 3)
    for corrupt_at in [*range(gamma), None]:
        proposer = SteeredProposer(draft, target, len(prompt), continuation, corrupt_at)
        decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, gamma + 1)
        out = [decoder.prefill(mx.array(prompt))]
        for _ in range(2):
            cycle = decoder.cycle()
            assert cycle.accepted == (gamma if corrupt_at is None else corrupt_at)
            out += cycle.tokens
            assert out == continuation[: len(out)]
            assert {c.offset for c in proposer.cache} == {len(decoder.tokens)}


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_every_acceptance_length_stays_lossless(loaded, family):
    model, tokenizer, path, _ = loaded[family]
    assert_every_acceptance_length(model, tokenizer, path)
