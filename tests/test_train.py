"""Draft training: the training forward is the inference forward, a few steps
lower the loss, checkpoints resume bit-identically, and what training writes
loads with ``load_draft`` and decodes losslessly."""

import io
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import WORDS, build_target
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.train.command import train_draft
from dflash_mlx.train.config import DraftTrainConfig, draft_config_for
from dflash_mlx.train.dflash2 import initial_draft
from dflash_mlx.train.data import SequenceData, StreamData, corpus_stream
from dflash_mlx.train.loop import OptimConfig, fit, list_checkpoints, lr_schedule
from dflash_mlx.train.dspark import DSparkObjective
from dflash_mlx.train.objective import DraftObjective, draft_train_forward, sample_anchors
from dflash_mlx.train.records import read_records


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small learnable corpus: sentences from a few fixed templates."""
    rng = np.random.default_rng(0)
    words = WORDS[:40]
    lines = []
    for _ in range(300):
        i = int(rng.integers(0, len(words) - 6))
        lines.append(" ".join(words[i : i + 6]) + " and " + words[(i * 7) % len(words)])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    jsonl = path.with_name("prompts.jsonl")
    jsonl.write_text("\n".join(json.dumps({"prompt": " ".join(l.split()[:3])}) for l in lines[:60]))
    return path, jsonl


@pytest.fixture(scope="module")
def hybrid(target_dirs):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    return model, tokenizer


TINY = dict(num_layers=2, block_size=8, seq_len=48, batch_size=4, blocks_per_seq=4,
            eval_prompts=2, eval_tokens=24)


DFLASH2 = dict(arch="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8)
DSPARK = dict(arch="dspark", markov_rank=8)


def shaken(draft):
    """A DFlash2 draft's convolutions moved off the identity they start at, so
    that a test of the network sees them."""
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 0.5 * mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.05 * mx.random.normal(conv.kernel_projection.weight.shape)
    return draft


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("arch", [{}, DFLASH2])
def test_training_forward_equals_cached_inference_block_by_block(sliding_window, arch):
    model, _ = build_target("qwen3_5")
    target = Target(model)
    config = draft_config_for(
        target, DraftTrainConfig(num_layers=2, block_size=8, sliding_window=sliding_window, **arch), 511
    )
    mx.random.seed(1)
    draft = initial_draft(config)
    if arch:
        shaken(draft)
    x = mx.random.randint(0, 500, (2, 40))
    feats = target.forward(x, None, config.target_layer_ids).features
    anchors = np.array([[3, 10, 20, 30], [1, 5, 17, 32]])
    block = np.array(x)[np.arange(2)[:, None, None], anchors[:, :, None] + np.arange(8)]
    block[:, :, 1:] = config.mask_token_id
    hidden = draft_train_forward(
        draft, target.embed(mx.array(block.reshape(2, -1))), feats, mx.array(anchors)
    ).reshape(2, 4, 8, -1)
    for i in range(2):
        for j in range(4):
            cache = draft.make_cache()
            draft.inject(feats[i : i + 1, : int(anchors[i, j])], cache)
            want = draft(target.embed(mx.array(block[i : i + 1, j])), cache)[0]
            assert mx.allclose(hidden[i, j], want, atol=1e-4).item(), (i, j)


def test_anchors_stay_in_range_and_leave_room_for_labels():
    rng = np.random.default_rng(0)
    lo, hi = np.array([1, 10, 5]), np.array([48, 30, 14])
    a = sample_anchors(rng, lo, hi, 6, 8)
    assert (a >= np.minimum(lo, hi - 8)[:, None]).all() and (a + 8 <= hi[:, None]).all()
    assert len(set(a[0])) == 6  # distinct when there is room


def test_schedule_warms_up_then_decays_to_the_floor():
    s = lr_schedule(OptimConfig(steps=100, learning_rate=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    assert s(0).item() == 0.0
    assert s(10).item() == pytest.approx(1e-3)
    assert s(100).item() == pytest.approx(1e-4, rel=1e-3)
    assert s(5).item() < s(10).item() and s(50).item() < s(10).item()


def _objective(hybrid, corpus, **over):
    model, tokenizer = hybrid
    target = Target(model)
    cfg = DraftTrainConfig(**{**TINY, **over})
    config = draft_config_for(target, cfg, target.vocab_size - 1)
    stream = corpus_stream(tokenizer, read_records([str(corpus[0])]), 2)
    kind = DSparkObjective if cfg.arch == "dspark" else DraftObjective
    return target, config, kind(target, config, cfg, StreamData(stream), seed=0)


def _fresh_draft(config, seed=0):
    mx.random.seed(seed)
    return initial_draft(config)


@pytest.mark.parametrize("arch", [{}, DSPARK])
def test_a_few_steps_lower_the_loss(hybrid, corpus, tmp_path, arch):
    _, config, objective = _objective(hybrid, corpus, **arch)
    draft = _fresh_draft(config)
    cfg = OptimConfig(steps=30, learning_rate=3e-3, warmup_steps=3, checkpoint_every=0, log_every=10)
    losses = fit(draft, objective.loss, objective.batch, cfg, tmp_path)["losses"]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:3]), losses


@pytest.mark.parametrize("arch", [{}, DFLASH2, DSPARK])
def test_checkpoint_resumes_bit_identically(hybrid, corpus, tmp_path, arch):
    _, config, objective = _objective(hybrid, corpus, **arch)
    cfg = OptimConfig(steps=6, learning_rate=3e-3, warmup_steps=2, checkpoint_every=2,
                      grad_accum=2, log_every=1)
    straight = _fresh_draft(config)
    a = fit(straight, objective.loss, objective.batch, cfg, tmp_path / "a")
    interrupted = _fresh_draft(config)
    fit(interrupted, objective.loss, objective.batch, cfg, tmp_path / "b", stop_after=3)
    assert [p.name for p in list_checkpoints(tmp_path / "b")][-1] == "step_00000003"
    resumed = _fresh_draft(config, seed=123)  # different init: everything must come from the checkpoint
    b = fit(resumed, objective.loss, objective.batch, cfg, tmp_path / "b")
    assert b["step"] == 6 and b["losses"] == a["losses"][3:]
    for (name, x), (_, y) in zip(tree_flatten(straight.parameters()), tree_flatten(resumed.parameters())):
        assert mx.array_equal(x, y).item(), name
    ck_a = mx.load(str(list_checkpoints(tmp_path / "a")[-1] / "optimizer.safetensors"))
    ck_b = mx.load(str(list_checkpoints(tmp_path / "b")[-1] / "optimizer.safetensors"))
    assert ck_a.keys() == ck_b.keys()
    assert all(mx.array_equal(ck_a[k], ck_b[k]).item() for k in ck_a)


def test_a_non_finite_loss_stops_before_its_update_and_ends_the_bar_line(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    model = nn.Linear(2, 1)

    def loss_fn(m, x):
        return (m(x) ** 2).mean(), mx.array(1.0)

    def batch(step, micro):  # the third step's input is NaN
        return mx.array([[1.0, float("nan") if step == 2 else 1.0]]), 1

    stream = Tty()
    cfg = OptimConfig(steps=5, warmup_steps=0, checkpoint_every=1, log_every=1)
    with pytest.raises(DFlashError, match="the loss is nan at step 3: training diverged"):
        fit(model, loss_fn, batch, cfg, tmp_path, stream=stream)
    assert "step 2/5" in stream.getvalue() and stream.getvalue().endswith("\n")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert all(mx.isfinite(p).all().item() for _, p in tree_flatten(model.parameters()))


def test_grad_accumulation_matches_one_big_batch(hybrid, corpus, tmp_path):
    """Two micro-batches of 2 give the update of the same 4 sequences at once.

    Compared: AdamW's moments after the step (saved with the checkpoint), from
    which the update is computed: m is linear in the gradient, v quadratic.
    Not the weights: at step 1 AdamW moves each weight by about lr * sign(g), so
    a gradient near 0 flips a whole step on a last-bit difference.
    """
    _, config, objective = _objective(hybrid, corpus, batch_size=2)
    cfg = OptimConfig(steps=1, learning_rate=1e-3, warmup_steps=0, grad_accum=2, grad_clip=0)
    d1 = _fresh_draft(config)
    fit(d1, objective.loss, objective.batch, cfg, tmp_path / "a")

    def joint(step, micro):
        parts = [objective.batch(step, m) for m in range(2)]
        cat = [mx.concatenate([p[i] for p in parts]) for i in range(4)]
        return (*cat, sum(p[4] for p in parts))

    d2 = _fresh_draft(config)
    fit(d2, objective.loss, joint, OptimConfig(**{**cfg.__dict__, "grad_accum": 1}), tmp_path / "b")
    a, b = (mx.load(str(list_checkpoints(tmp_path / run)[-1] / "optimizer.safetensors")) for run in "ab")
    moments = [k for k in a if k.endswith((".m", ".v"))]
    assert len(moments) == 2 * len(tree_flatten(d1.trainable_parameters())) and a.keys() == b.keys()
    # The runs sum the same per-token gradients grouped differently (two halves
    # then added, against one pass; a BLAS may also block 2 and 4 rows
    # differently), so entries differ by rounding: a few float32 ulps of the
    # largest terms per sum, compounded through a 2-layer backward pass. 2^8 ulps
    # of the array's largest entry (3e-5 relative) is >10x what MLX's bundled
    # BLAS and OpenBLAS give (14 and 21), while a micro-batch dropped, counted
    # twice or misweighted moves the moments by tens of percent.
    ulp = np.finfo(np.float32).eps
    for name in moments:
        tol = 2**8 * ulp * mx.abs(b[name]).max().item()
        assert mx.abs(a[name] - b[name]).max().item() <= tol, name


def greedy(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


@pytest.mark.parametrize("arch", [{}, DSPARK])
def test_trained_draft_loads_and_decodes_losslessly(hybrid, target_dirs, corpus, tmp_path, arch):
    from dflash_mlx.convert import convert_draft

    model, tokenizer = hybrid
    res = train_draft(
        str(target_dirs["qwen3_5"]), str(tmp_path / "run"), [str(corpus[0])],
        DraftTrainConfig(**TINY, **arch), OptimConfig(steps=4, warmup_steps=1, checkpoint_every=2),
        export_hf_dir=str(tmp_path / "hf"), model_and_tokenizer=hybrid,
    )
    assert res["final_eval"]["cycles"] > 0
    for path in (res["draft_dir"], res["hf_dir"]):
        draft = load_draft(path)
        assert draft.config.block_size == 8 and len(draft.layers) == 2
        for prompt in ["the quick brown fox", "hello world"]:
            ids = tokenizer.encode(prompt)
            out = generate(model, draft, tokenizer, prompt, max_tokens=32)
            want = greedy(model, ids, 32)
            assert out.tokens == want[: len(out.tokens)] and len(out.tokens) > 8
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    if arch:  # DeepSpec's layout: flat keys, block_size the trained gamma, the borrowed copies in
        assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["block_size"] == 7 and hf["markov_rank"] == 8
        assert {"embed_tokens.weight", "lm_head.weight"} <= mx.load(str(tmp_path / "hf" / "model.safetensors")).keys()
    else:
        assert hf["architectures"] == ["DFlashDraftModel"] and hf["dflash_config"]["block_size"] == 8
    assert hf["torch_dtype"] == "bfloat16"
    converted = convert_draft(res["hf_dir"], tmp_path / "converted", dtype="float32")
    assert load_draft(str(converted)).config.target_layer_ids == draft.config.target_layer_ids


def test_self_distillation_trains_on_the_targets_own_continuations(hybrid, target_dirs, corpus, tmp_path):
    model, tokenizer = hybrid
    cfg = DraftTrainConfig(**{**TINY, "self_distill": True, "distill_tokens": 24, "num_prompts": 20})
    res = train_draft(
        str(target_dirs["qwen3_5"]), str(tmp_path / "run"), [str(corpus[1])], cfg,
        OptimConfig(steps=2, warmup_steps=1), model_and_tokenizer=hybrid,
    )
    data = SequenceData.load(tmp_path / "run" / "distill.npz")
    assert len(data) == 20
    seq, p = data.sequences[0], int(data.prompt_lens[0])
    assert seq[p:].tolist() == greedy(model, seq[:p].tolist(), len(seq) - p)
    assert res["draft_dir"] is not None


def test_resuming_with_other_settings_is_refused(hybrid, target_dirs, corpus, tmp_path):
    args = (str(target_dirs["qwen3_5"]), str(tmp_path / "run"), [str(corpus[0])])
    train_draft(*args, DraftTrainConfig(**TINY), OptimConfig(steps=2, warmup_steps=0),
                stop_after=1, model_and_tokenizer=hybrid)
    with pytest.raises(DFlashError, match="different"):
        train_draft(*args, DraftTrainConfig(**{**TINY, "num_layers": 1}),
                    OptimConfig(steps=2, warmup_steps=0), model_and_tokenizer=hybrid)


@pytest.mark.parametrize("arch", [{}, DSPARK])
def test_cached_features_equal_live_ones_to_float16(hybrid, corpus, arch):
    model, tokenizer = hybrid
    target = Target(model)
    seqs = [np.array(tokenizer.encode(l), np.int32) for l in corpus[0].read_text().splitlines()[:12]]
    data = SequenceData(seqs, [3] * len(seqs), pad_id=2)
    live_cfg = DraftTrainConfig(**{**TINY, "seq_len": 24, "blocks_per_seq": 2, **arch})
    cached_cfg = DraftTrainConfig(**{**TINY, "seq_len": 24, "blocks_per_seq": 2, "cache_features": True, **arch})
    config = draft_config_for(target, live_cfg, target.vocab_size - 1)
    kind = DSparkObjective if arch else DraftObjective
    live = kind(target, config, live_cfg, data, seed=0).batch(5, 1)
    cached = kind(target, config, cached_cfg, data, seed=0).batch(5, 1)
    for i in (0, 2, 3):
        assert mx.array_equal(live[i], cached[i]).item()
    assert mx.allclose(live[1], cached[1], rtol=2e-3, atol=2e-3).item()
    if arch:  # the target's logits (the teacher p), from its cached final hidden states
        assert mx.allclose(live[4], cached[4], rtol=1e-2, atol=1e-2).item()


def test_cli_trains_resumes_and_exports(target_dirs, corpus, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    args = ["train", "--model", str(target_dirs["qwen3_5"]), "--out", str(tmp_path / "run"),
            "--data", str(corpus[0]), "--layers", "2", "--block-size", "8", "--seq-len", "48",
            "--batch-size", "2", "--blocks-per-seq", "2", "--steps", "4", "--warmup", "1",
            "--checkpoint-every", "2", "--eval-count", "2", "--eval-tokens", "16",
            "--export-hf", str(tmp_path / "hf"), "--target-layer-ids", "0,2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert "loss" in result.stderr and "tok/s" in result.stderr and "held-out tau" in result.stderr
    draft = load_draft(str(tmp_path / "run" / "draft"))
    assert draft.config.target_layer_ids == [0, 2]
    assert load_draft(str(tmp_path / "hf")).config.block_size == 8
    again = CliRunner().invoke(app, args)  # finished run: resumes at the last step, trains nothing
    assert again.exit_code == 0 and "resuming from" in again.stderr and "step 1/" not in again.stderr


@pytest.mark.parametrize("extra, fragment", [
    ([], "--data"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--data", "X", "--block-size", "1"], "--block-size"),
    (["--data", "X", "--target-layer-ids", "1,a"], "--target-layer-ids"),
    (["--data", "X", "--arch", "dflash3"], "--arch"),
    (["--data", "X", "--arch", "dflash2", "--selector", "64,0"], "--selector's k"),
    (["--data", "X", "--arch", "dflash2", "--conv", "2"], "--conv"),
    (["--data", "X", "--arch", "dflash2", "--conv", "2,7"], "conv_group_size 7 does not divide"),
    (["--data", "X", "--arch", "dflash2", "--selector-weight", "nan"], "--selector-weight"),
    (["--data", "X", "--arch", "dspark", "--markov-rank", "-1"], "--markov-rank must be >= 0"),
    (["--data", "X", "--arch", "dspark", "--sliding-window", "4", "--layers", "2"], "no mask"),
])
def test_cli_train_bad_input_is_one_error_line(target_dirs, tmp_path, extra, fragment):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    result = CliRunner().invoke(app, ["train", "--model", str(target_dirs["qwen3_5"]),
                                      "--out", str(tmp_path / "run"), *extra])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
