"""Training DFlash2 drafts (``train --arch dflash2``): the objective equals a
NumPy computation of the block loss plus the selector's, training lowers the
selector's loss, and what the command writes (our layout, z-lab's layout,
converted) loads as the draft it trained. The training forward and exact
resume are tested with v1's in test_train.py."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from dflash_mlx import generate, load_draft
from dflash_mlx.train.dflash2 import selector_loss
from dflash_mlx.train.loop import OptimConfig, fit, list_checkpoints
from dflash_mlx.train.objective import block_loss
from test_train import DFLASH2, _fresh_draft, _objective, corpus, hybrid  # noqa: F401 (fixtures)


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def reference_loss(draft, hidden, raw_logits, tokens, weights, selector_weight):
    """Block loss + selector loss from the equations, in float64, row by row."""
    c = draft.config
    sel = draft.candidate_selector
    Wp, P, S = (np.array(a, np.float64) for a in (sel.hidden_projection.weight,
                                                  sel.predecessor_codebook.weight, sel.successor_codebook.weight))
    h = np.array(hidden, np.float64).reshape(-1, hidden.shape[-1])
    z = np.array(raw_logits, np.float64).reshape(-1, raw_logits.shape[-1]) * c.output_multiplier
    z = c.final_logit_softcapping * np.tanh(z / c.final_logit_softcapping)
    t = np.array(tokens)
    labels, prevs = t[..., 1:].reshape(-1), t[..., :-1].reshape(-1)
    w = np.broadcast_to(np.array(weights, np.float64), t[..., 1:].shape).reshape(-1)
    blocks = len(labels) // len(weights)
    block = -(log_softmax(z)[np.arange(len(labels)), labels] * w).sum() / (np.array(weights, np.float64).sum() * blocks)
    num = den = 0.0
    found = 0
    for row in range(len(labels)):
        cand = np.argsort(-z[row])[: c.selector_top_k]
        if labels[row] not in cand:
            continue
        found += 1
        s = z[row, cand] + S[cand] @ ((Wp @ h[row]) * P[prevs[row]])
        num += w[row] * -log_softmax(s)[list(cand).index(labels[row])]
        den += w[row]
    return block + selector_weight * num / den, found, len(labels)


def test_loss_equals_the_equations_in_numpy(hybrid, corpus):
    target, config, objective = _objective(hybrid, corpus, **{**DFLASH2, "selector_top_k": 64,
                                                              "selector_weight": 0.5})
    config.output_multiplier, config.final_logit_softcapping = 1.5, 8.0
    draft = _fresh_draft(config)
    emb, feats, anchors, tokens, _ = objective.batch(0, 0)
    hidden, _ = objective.block_rows(draft, emb, feats, anchors)
    want, found, rows = reference_loss(draft, hidden, target.logits(hidden), tokens, objective.weights, 0.5)
    assert 0 < found < rows  # both kinds of row: scored, and left out (token not a candidate)
    loss, weight = objective.loss(draft, emb, feats, anchors, tokens)
    assert loss.item() == pytest.approx(want, rel=1e-5) and weight.item() == anchors.size


def test_a_few_steps_lower_the_selector_loss_on_a_fixed_batch(hybrid, corpus, tmp_path):
    # every id a candidate, so every row is scored before and after (with fewer,
    # rows join the loss as their token enters the top k, which moves its mean)
    target, config, objective = _objective(hybrid, corpus, **DFLASH2)
    config.selector_top_k = target.vocab_size
    draft = _fresh_draft(config)
    batch = objective.batch(0, 0)

    def losses():
        hidden, logits = objective.block_rows(draft, *batch[:3])
        return (block_loss(logits, batch[3], objective.weights).item(),
                selector_loss(draft, hidden, logits, batch[3], objective.weights).item())

    before = losses()
    cfg = OptimConfig(steps=12, learning_rate=3e-3, warmup_steps=0, checkpoint_every=0)
    fit(draft, objective.loss, lambda step, micro: batch, cfg, tmp_path)
    after = losses()
    assert after[0] < 0.8 * before[0] and after[1] < 0.8 * before[1], (before, after)


def block_rows_and_walk(draft, target, features, block):
    """Scaled logits of rows 1..b-1 and the selector's greedy walk for one block."""
    cache = draft.make_cache()
    draft.inject(features, cache)
    hidden = draft(target.embed(block), cache)[0, 1:]
    logits = draft.scale_logits(target.logits(hidden))
    return logits, draft.candidate_selector.walk(hidden, logits, block[0, :1])[0]


def test_cli_trains_and_exports_a_draft_that_loads_as_trained(hybrid, target_dirs, corpus, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx import Target
    from dflash_mlx.cli import app
    from dflash_mlx.convert import convert_draft

    run, hf = tmp_path / "run", tmp_path / "hf"
    args = ["train", "--model", str(target_dirs["qwen3_5"]), "--out", str(run), "--data", str(corpus[0]),
            "--arch", "dflash2", "--selector", "8,4", "--conv", "2,8",
            "--layers", "2", "--block-size", "8", "--seq-len", "48", "--batch-size", "2",
            "--blocks-per-seq", "2", "--steps", "3", "--warmup", "1", "--checkpoint-every", "2",
            "--eval-count", "2", "--eval-tokens", "16", "--export-hf", str(hf), "--hf-dtype", "float32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert "held-out tau" in result.stderr

    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k", "block_size")} == \
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4, "block_size": 8}
    names = set(mx.load(str(hf / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    assert not any(n.endswith("_codebook.weight") for n in names)

    model, tokenizer = hybrid
    target = Target(model)
    trained = load_draft(str(run / "draft"))
    trained.load_weights(str(list_checkpoints(run)[-1] / "model.safetensors"))  # what training ended with
    x = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog")[:12])[None]
    features = target.forward(x, None, trained.config.target_layer_ids).features
    block = mx.concatenate([x[:, -1:], mx.full((1, 7), trained.config.mask_token_id)], axis=1)
    want_logits, want_walk = block_rows_and_walk(trained, target, features[:, :-1], block)
    converted = convert_draft(str(hf), tmp_path / "converted", dtype="float32")
    for path in (run / "draft", hf, converted):
        draft = load_draft(str(path))
        for (name, a), (_, b) in zip(tree_flatten(trained.parameters()), tree_flatten(draft.parameters())):
            assert mx.array_equal(a, b).item(), (path, name)
        logits, walk = block_rows_and_walk(draft, target, features[:, :-1], block)
        assert mx.array_equal(logits, want_logits).item() and walk.tolist() == want_walk.tolist(), path

    ids = tokenizer.encode("hello world")
    out = generate(model, load_draft(str(hf)), tokenizer, ids, max_tokens=24)
    assert out.tokens == [t for t, _ in generate_step(mx.array(ids), model, max_tokens=24)][: len(out.tokens)]
    assert len(out.tokens) == 24
