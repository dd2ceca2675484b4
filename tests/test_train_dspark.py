"""Training DSpark drafts (``train --arch dspark``): the config it builds, the
training rows equal the inference walk's, the loss is DSpark's formula, and
the DeepSpec-layout export runs as the MLX draft does. Resume, few-step
training, lossless decoding and cached features: the parametrised tests in
test_train.py."""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import build_target
from mlx.utils import tree_flatten

from dflash_mlx import Target, load_draft
from dflash_mlx.draft import DSparkConfig, DSparkDraft
from dflash_mlx.train.command import train_draft
from dflash_mlx.train.config import DraftTrainConfig, draft_config_for
from dflash_mlx.train.data import StreamData
from dflash_mlx.train.dflash2 import initial_draft
from dflash_mlx.train.dspark import DSparkObjective, confidence_logits, dspark_loss
from dflash_mlx.train.loop import OptimConfig
from dflash_mlx.train.objective import draft_train_forward

TINY = dict(arch="dspark", num_layers=2, block_size=8, seq_len=48, batch_size=2, blocks_per_seq=3, markov_rank=8)


@pytest.fixture(scope="module")
def target():
    return Target(build_target("qwen3_5")[0])


def shaken(draft: DSparkDraft) -> DSparkDraft:
    """The Markov head moved off the W2 = 0 it starts at, so that a test sees it."""
    w2 = draft.markov_head.markov_w2
    w2.weight = 0.5 * mx.random.normal(w2.weight.shape)
    return draft


def test_config_is_deepspecs_with_the_trained_block(target):
    config = draft_config_for(target, DraftTrainConfig(**{**TINY, "block_size": 16}), 511)
    assert isinstance(config, DSparkConfig) and config.block_size == 16  # the anchor and 15 drafts
    written = config.to_dict()
    assert written["architectures"] == ["Qwen3DSparkModel"] and written["block_size"] == 15
    assert written["enable_confidence_head"] and written["confidence_head_with_markov"]
    assert written["markov_rank"] == 8 and written["markov_head_type"] == "vanilla" and written["num_anchors"] == 3
    assert DSparkConfig.from_dict(written) == config
    bare = draft_config_for(target, DraftTrainConfig(**{**TINY, "markov_rank": 0}), 511)
    assert bare.enable_confidence_head and not bare.confidence_head_with_markov


def test_a_resumed_run_keeps_only_its_own_architectures_settings():
    v1, v2, spark = (DraftTrainConfig(arch=a).settings() for a in ("dflash", "dflash2", "dspark"))
    assert "markov_rank" not in v1 and "markov_rank" not in v2 and "arch" not in v1  # earlier runs still resume
    assert spark["markov_rank"] == 256 and "selector_rank" not in spark and spark["arch"] == "dspark"


def test_training_rows_equal_the_inference_walks(target):
    cfg = DraftTrainConfig(**TINY)
    config = draft_config_for(target, cfg, 511)
    mx.random.seed(3)
    draft = shaken(initial_draft(config))
    stream = np.random.default_rng(0).integers(0, 500, 4000).astype(np.int32)
    objective = DSparkObjective(target, config, cfg, StreamData(stream), seed=0)
    emb, feats, anchors, tokens, teacher, _ = objective.batch(0, 0)
    g = config.block_size - 1
    hidden = draft_train_forward(draft, emb, feats, anchors).reshape(2, 3, g, -1)
    logits = target.logits(hidden)
    for i in range(2):
        for j in range(3):
            a, block = int(anchors[i, j]), tokens[i, j]
            cache = draft.make_cache()
            draft.inject(feats[i : i + 1, :a], cache)
            want = draft(target.embed(draft.block_ids(block[:1])), cache)[0]  # the proposer's block
            assert mx.allclose(hidden[i, j], want, atol=1e-4).item(), (i, j)
            # the walk's first row and every confidence, with the training's teacher-forced tokens
            drafted, _, c = draft.walk(want, target.logits(want), block[:1], lambda z: (mx.argmax(z, axis=-1), None))
            z1 = logits[i, j, 0] + draft.markov_head(block[:1])[0]
            assert drafted[0].item() == mx.argmax(z1).item()
            forced = mx.sigmoid(confidence_logits(draft, hidden[i, j], block[:-1]))
            assert mx.allclose(forced, draft.confidence(want, block[:-1]), atol=1e-4).item()
            assert mx.allclose(c[0], forced[0], atol=1e-4).item()  # slot 1 reads the anchor either way
    assert teacher.shape == (2, 3, g, target.vocab_size)


def stream_rows(objective, row, step, micro):
    """The batch's token rows (as ``DraftObjective.batch`` draws them)."""
    rng = np.random.default_rng([objective.seed, step, micro])
    x, _, _ = objective.data.sample(rng, objective.train.batch_size, objective.train.seq_len)
    return x[row : row + 1]


def test_teacher_is_the_targets_own_next_token_distribution(target):
    cfg = DraftTrainConfig(**TINY)
    config = draft_config_for(target, cfg, 511)
    stream = np.random.default_rng(1).integers(0, 500, 4000).astype(np.int32)
    objective = DSparkObjective(target, config, cfg, StreamData(stream), seed=0)
    _, _, anchors, tokens, teacher, _ = objective.batch(2, 0)
    x = stream_rows(objective, 0, 2, 0)
    full = target.model(mx.array(x))[0]  # mlx-lm's own logits
    a = int(anchors[0, 1])
    assert mx.array_equal(tokens[0, 1], mx.array(x[0, a : a + 8])).item()
    assert mx.allclose(teacher[0, 1], full[a : a + 7], atol=1e-4).item()


def test_loss_is_dsparks_formula(target):
    config = draft_config_for(target, DraftTrainConfig(**TINY), 511)
    mx.random.seed(5)
    draft = shaken(initial_draft(config))
    g, V, H = 7, target.vocab_size, target.hidden_size
    hidden, logits, teacher = mx.random.normal((2, g, H)), 3 * mx.random.normal((2, g, V)), 3 * mx.random.normal((2, g, V))
    tokens = mx.random.randint(0, V, (2, g + 1))
    w = mx.exp(-mx.arange(g) / 4.0)
    got = dspark_loss(draft, hidden, logits, tokens, teacher, w).item()

    def np_(t):
        return np.array(t.astype(mx.float32), dtype=np.float64)

    z = np_(logits) + np_(draft.markov_head(tokens[:, :-1]))
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    p = np.exp(np_(teacher) - np_(teacher).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = np.array(tokens[:, 1:])
    ce = -np.log(np.take_along_axis(q, labels[..., None], -1)[..., 0])
    l1 = np.abs(q - p).sum(-1)
    c = np_(draft.confidence(hidden.reshape(-1, H), tokens[:, :-1].reshape(-1))).reshape(2, g)
    t = 1 - l1 / 2
    bce = -(t * np.log(c) + (1 - t) * np.log(1 - c))
    want = ((0.1 * ce + 0.9 * l1 + bce) * np_(w)).sum() / (np_(w).sum() * 2)
    assert got == pytest.approx(want, rel=1e-4)


def test_exported_deepspec_folder_runs_as_the_mlx_draft(target_dirs, tmp_path):
    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog sat on the log\n" * 40)
    res = train_draft(
        str(target_dirs["qwen3_5"]), str(tmp_path / "run"), [str(corpus)],
        DraftTrainConfig(**{**TINY, "eval_prompts": 0}), OptimConfig(steps=2, warmup_steps=1),
        export_hf_dir=str(tmp_path / "hf"), hf_dtype="float32", model_and_tokenizer=(model, tokenizer),
    )
    mlx_draft, hf_draft = load_draft(res["draft_dir"]), load_draft(res["hf_dir"])
    assert isinstance(hf_draft, DSparkDraft) and hf_draft.config == mlx_draft.config
    mine, theirs = dict(tree_flatten(mlx_draft.parameters())), dict(tree_flatten(hf_draft.parameters()))
    assert mine.keys() == theirs.keys() and all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    t = Target(model)
    feats = t.forward(mx.array([tokenizer.encode("the cat sat on")]), None, mlx_draft.config.target_layer_ids).features
    anchor = mx.array([5])
    walks = []
    for draft in (mlx_draft, hf_draft):
        cache = draft.make_cache()
        draft.inject(feats, cache)
        h = draft(t.embed(draft.block_ids(anchor)), cache)[0]
        walks.append(draft.walk(h, t.logits(h), anchor, lambda z: (mx.argmax(z, axis=-1), None)))
    assert mx.array_equal(walks[0][0], walks[1][0]).item() and mx.array_equal(walks[0][2], walks[1][2]).item()
    copies = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    assert mx.allclose(copies["embed_tokens.weight"], t.inner.embed_tokens.weight).item()


def test_cli_trains_a_dspark_draft(target_dirs, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog sat on the log\n" * 40)
    result = CliRunner().invoke(app, [
        "train", "--model", str(target_dirs["qwen3_5"]), "--out", str(tmp_path / "run"), "--data", str(corpus),
        "--arch", "dspark", "--markov-rank", "4", "--layers", "1", "--block-size", "6", "--seq-len", "32",
        "--batch-size", "2", "--blocks-per-seq", "2", "--steps", "2", "--warmup", "1", "--eval-count", "1",
        "--eval-tokens", "8", "--export-hf", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.stderr
    for path in ("run/draft", "hf"):
        draft = load_draft(str(tmp_path / path))
        assert isinstance(draft, DSparkDraft) and draft.config.block_size == 6 and draft.config.markov_rank == 4
