"""DSpark drafts in LiquidAI's packaging (``Lfm2DSparkDraftModel``: nested context
keys, interleaved RoPE, no head of its own) and Red Hat's speculators format
(``speculators_config``: the backbone nested, feature layers one higher, a
reduced drafting vocabulary with its d2t map) load through ``load_draft``,
follow the float64 DSpark equations in that layout (and not with the layout's
difference undone), and stay token-identical to mlx-lm's greedy output.

The fixtures are tiny DeepSpec drafts (test_dspark.py's) rewritten into each
packaging's on-disk layout, for targets of the same shapes (LiquidAI's drafts
are made for LFM2 targets: tests/test_lfm2.py runs the layout on one)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.draft import DSparkConfig, DSparkDraft, SubsetHead
from dflash_mlx.loop.decoder import DSparkProposer
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams
from checkpoints import text_config
from test_dspark import assert_every_acceptance_length, greedy_reference, reference, with_config, write_dspark_draft

# interleaved RoPE: the draft's KV injection runs layer by layer, and says so once
pytestmark = pytest.mark.filterwarnings("ignore:dflash-mlx. KV injection runs layer by layer")

LIQUID_GAMMA = 9  # LiquidAI's block
GAMMA = 5
KEPT = 300  # of the tiny targets' 512 ids
CONTEXT_KEYS = ("mask_token_id", "target_layer_ids", "num_target_layers")
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def write_liquid(source, path):
    """The DeepSpec draft at ``source`` in LiquidAI's layout."""
    cfg = json.loads((source / "config.json").read_text())
    nested = {key: cfg.pop(key) for key in CONTEXT_KEYS}
    for key in ("num_anchors", "confidence_head_with_markov"):  # LiquidAI writes neither
        cfg.pop(key)
    cfg.update(architectures=["Lfm2DSparkDraftModel"], rope_is_neox_style=False, dflash_config=nested)
    weights = {f"model.{name}": w for name, w in mx.load(str(source / "model.safetensors")).items()
               if not name.startswith(("embed_tokens", "lm_head"))}
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def write_speculators(source, path, kept):
    """The DeepSpec draft at ``source`` in the speculators format, drafting over
    the target ids ``kept`` (increasing): W2's and the head's rows at them, the
    d2t offsets and the t2d mask."""
    cfg = json.loads((source / "config.json").read_text())
    top = {key: cfg.pop(key) for key in ("block_size", "mask_token_id", "num_target_layers", "num_anchors",
                                          *HEAD_KEYS)}
    aux = [i + 1 for i in cfg.pop("target_layer_ids")]
    cfg.pop("architectures")
    gamma = top["block_size"]
    config = {"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
              "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}},
              "transformer_layer_config": cfg, "draft_vocab_size": len(kept), "aux_hidden_state_layer_ids": aux,
              "sample_from_anchor": True, **top}
    weights = dict(mx.load(str(source / "model.safetensors")))
    ids = mx.array(kept)
    weights.pop("embed_tokens.weight")
    weights["lm_head.weight"] = weights["lm_head.weight"][ids]
    weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][ids]
    weights["d2t"] = mx.array(np.asarray(kept) - np.arange(len(kept)), dtype=mx.int64)
    weights["t2d"] = mx.array(np.isin(np.arange(cfg["vocab_size"]), kept))
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, target_dirs):
    """family -> (mlx-lm model, tokenizer, {layout: draft directory}, the kept ids)."""
    out = {}
    for family in ("llama", "qwen3", "qwen3_5"):
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        config = json.loads((target_dirs[family] / "config.json").read_text())
        root = tmp_path_factory.mktemp(f"packaging-{family}")
        write_dspark_draft(root / "liquid-source", model, config, gamma=LIQUID_GAMMA)
        write_dspark_draft(root / "speculators-source", model, config)
        write_liquid(root / "liquid-source", root / "liquid")
        # the greedy continuation of the acceptance test's prompt stays in the kept ids
        rng = np.random.default_rng(7)
        wanted = greedy_reference(model, tokenizer.encode("the quick brown fox"), 3 * GAMMA + 3)
        vocab = text_config(config)["vocab_size"]
        kept = set(wanted) | set(rng.choice(vocab - 1, KEPT, replace=False).tolist())  # never the mask id
        kept = sorted(set(wanted) | set(sorted(kept - set(wanted))[: KEPT - len(set(wanted))]))
        write_speculators(root / "speculators-source", root / "speculators", kept)
        out[family] = (model, tokenizer, root, kept)
    return out


def test_liquids_layout_loads(pairs):
    root = pairs["qwen3"][2]
    draft = load_draft(str(root / "liquid"))
    assert isinstance(draft, DSparkDraft) and draft.config.block_size == LIQUID_GAMMA + 1
    assert draft.config.rope_traditional and all(layer.self_attn.rope.traditional for layer in draft.layers)
    assert draft.confidence_head.proj.weight.shape == (1, 64 + 8)  # [h ; W1[x]], LiquidAI's default
    assert draft.d2t is None
    assert DSparkConfig.from_dict(draft.config.to_dict()) == draft.config


def test_speculators_layout_loads(pairs):
    root, kept = pairs["qwen3"][2], pairs["qwen3"][3]
    draft = load_draft(str(root / "speculators"))
    source = json.loads((root / "speculators-source" / "config.json").read_text())
    assert draft.config.block_size == GAMMA + 1 and draft.config.draft_vocab_size == KEPT
    assert draft.config.target_layer_ids == source["target_layer_ids"]  # aux ids, one lower
    assert draft.vocab_ids.tolist() == kept
    assert draft.markov_head.markov_w1.weight.shape == (512, 8) and draft.markov_head.markov_w2.weight.shape == (KEPT, 8)
    assert DSparkConfig.from_dict(draft.config.to_dict()) == draft.config


def draft_rows(draft, model, tokenizer, cfg, params=SamplingParams()):
    """(U, drafts, c, q, features, anchor) of one block after a short prompt."""
    target = Target(model)
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps"))
    out = target.forward(prompt[None], target.make_cache(), cfg["target_layer_ids"])
    anchor = mx.argmax(target.logits(out.hidden[:, -1]), axis=-1).astype(mx.int32)
    proposer = DSparkProposer(draft, target)
    proposer.observe(out.features, prompt)
    U = np.array(proposer.propose(anchor, draft.config.block_size), dtype=np.float64)
    drafted, q = proposer.draft_block(anchor, draft.config.block_size, BlockSampler(params))
    c = np.array(proposer.confidence, dtype=np.float64)
    return U, drafted.tolist(), c, q, np.array(out.features[0], dtype=np.float64), anchor.item()


def float64(path):
    return {name: np.array(a.astype(mx.float32), dtype=np.float64) for name, a in mx.load(str(path)).items()}


def agrees(ours, ref):
    finite = np.isfinite(ref[0])
    return (np.array_equal(np.isfinite(ours[0]), finite) and np.allclose(ours[0][finite], ref[0][finite], 1e-3, 1e-3),
            ours[1] == ref[1], np.allclose(ours[2], ref[2], atol=1e-4))


def test_liquid_follows_the_equations_with_interleaved_rope(pairs):
    model, tokenizer, root, _ = pairs["qwen3"]
    cfg = json.loads((root / "liquid-source" / "config.json").read_text())
    w = float64(root / "liquid-source" / "model.safetensors")
    draft = load_draft(str(root / "liquid"), dtype="float32")
    U, drafts, c, _, features, anchor = draft_rows(draft, model, tokenizer, cfg)
    assert agrees((U, drafts, c), reference(w, cfg, features, anchor, interleaved=True)) == (True, True, True)
    assert not agrees((U, drafts, c), reference(w, cfg, features, anchor))[0]  # split-half RoPE is told apart


def test_speculators_follows_the_equations_over_its_ids(pairs):
    """U is -inf outside the kept ids, W2's rows are theirs, drafts are target
    ids; reading the draft's index d as the target id (d2t ignored) is told apart."""
    model, tokenizer, root, kept = pairs["qwen3"]
    cfg = json.loads((root / "speculators-source" / "config.json").read_text())
    w = float64(root / "speculators-source" / "model.safetensors")
    w["markov_head.markov_w2.weight"] = w["markov_head.markov_w2.weight"][kept]
    draft = load_draft(str(root / "speculators"), dtype="float32")
    U, drafts, c, _, features, anchor = draft_rows(draft, model, tokenizer, cfg)
    assert set(drafts) <= set(kept)
    assert agrees((U, drafts, c), reference(w, cfg, features, anchor, kept=kept)) == (True, True, True)
    assert agrees((U, drafts, c), reference(w, cfg, features, anchor, kept=list(range(KEPT)))) != (True, True, True)

    # at T > 0, q_k is the softmax of z_k / T over the kept ids, -inf elsewhere
    params = SamplingParams(temperature=0.8, seed=2)
    U, drafts, _, q, _, anchor = draft_rows(draft, model, tokenizer, cfg, params)
    previous = [anchor] + drafts[:-1]
    z = U[:, kept] + w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
    z = z / 0.8 - np.log(np.exp(z / 0.8).sum(-1, keepdims=True))
    q = np.array(q, dtype=np.float64)
    assert np.isneginf(np.delete(q, kept, axis=1)).all() and np.allclose(q[:, kept], z, atol=1e-3)


@pytest.mark.parametrize("layout", ["liquid", "speculators"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_greedy_output_is_mlx_lm_greedy_output(pairs, family, layout):
    model, tokenizer, root, _ = pairs[family]
    draft = load_draft(str(root / layout))
    gamma = draft.config.block_size - 1
    for text in ("the quick brown fox", "hello world what is"):
        ids = tokenizer.encode(text)
        want = greedy_reference(model, ids, 24)
        for block_size in (2, gamma + 1):
            assert generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size).tokens == want


@pytest.mark.parametrize("layout", ["liquid", "speculators"])
def test_every_acceptance_length_stays_lossless(pairs, layout):
    model, tokenizer, root, _ = pairs["qwen3"]
    assert_every_acceptance_length(model, tokenizer, root / layout)


def test_a_speculators_draft_needs_no_target_layer_count(pairs, target_dirs, tmp_path):
    """The format does not record the target's layer count: without one the
    draft loads, the pair check takes the target's, the output stays mlx-lm's,
    and a conversion keeps it unstated; a target too shallow for its feature
    layers is refused in one line."""
    model, tokenizer, root, _ = pairs["qwen3"]
    path = with_config(tmp_path, root / "speculators", "no-count", lambda cfg: cfg.pop("num_target_layers"))
    draft = load_draft(path)
    assert draft.config.num_target_layers is None
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 16)
    assert generate(model, draft, tokenizer, ids, max_tokens=16, block_size=GAMMA + 1).tokens == want
    assert DSparkConfig.from_dict(draft.config.to_dict()) == draft.config
    shallow, shallow_tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    shallow.model.layers = shallow.model.layers[: max(draft.config.target_layer_ids)]
    with pytest.raises(DFlashError, match="out of range") as e:
        generate(shallow, draft, shallow_tokenizer, ids, max_tokens=4)
    assert "\n" not in str(e.value)


def speculators_edit(edit):
    return lambda cfg: edit(cfg, cfg["speculators_config"]["proposal_methods"][0])


WRONG = {
    "no anchor layout": (speculators_edit(lambda cfg, m: (cfg.pop("sample_from_anchor"), m.pop("speculative_tokens"))),
                         "anchor layout is unknown"),
    "fill-in layout": (speculators_edit(lambda cfg, m: (cfg.pop("sample_from_anchor"),
                                                        m.update(speculative_tokens=GAMMA - 1))), "anchor-first"),
    "disagreeing layout": (speculators_edit(lambda cfg, m: m.update(speculative_tokens=GAMMA - 1)), "disagree"),
    "odd proposal width": (speculators_edit(lambda cfg, m: m.update(speculative_tokens=GAMMA + 3)), "proposes 8"),
    "embedding output": (lambda cfg: cfg.update(aux_hidden_state_layer_ids=[0, 3]), "embedding output"),
    "no backbone": (lambda cfg: cfg.pop("transformer_layer_config"), "transformer_layer_config"),
    "not dspark": (lambda cfg: cfg.update(speculators_model_type="eagle3"), "not a DSpark draft"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_speculators_layout_is_refused_in_one_line(pairs, tmp_path, name):
    edit, message = WRONG[name]
    with pytest.raises(DFlashError, match=message) as e:
        load_draft(with_config(tmp_path, pairs["qwen3"][2] / "speculators", "wrong", edit))
    assert "\n" not in str(e.value)


def test_a_broken_d2t_map_and_a_second_vocabulary_are_refused(pairs, tmp_path):
    model, tokenizer, root, _ = pairs["qwen3"]
    weights = dict(mx.load(str(root / "speculators" / "model.safetensors")))
    weights["d2t"] = mx.zeros_like(weights["d2t"]) - 1  # ids -1, 0, 1, ...: one below zero
    path = tmp_path / "broken"
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text((root / "speculators" / "config.json").read_text())
    with pytest.raises(DFlashError, match="d2t map") as e:
        load_draft(str(path))
    assert "\n" not in str(e.value)
    target = Target(model)
    with pytest.raises(DFlashError, match="its own 300 ids"):
        DSparkProposer(load_draft(str(root / "speculators")), target, head=SubsetHead(target, mx.arange(64)))
