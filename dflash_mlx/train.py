"""Train a DFlash draft for any supported mlx-lm target (``dflash-mlx train``).

The objective is the published block-diffusion recipe (DESIGN.md §2):

- anchor positions are sampled in each training sequence;
- each block is [anchor token, mask x (b-1)] at positions anchor..anchor+b-1;
- block queries see the frozen target's features of every position before the
  anchor (as injected context keys/values) and every position of their own
  block (only the earlier ones on causal layers: the draft's sliding layers
  unless the config sets ``is_causal``, as at inference);
- cross-entropy on block positions 1..b-1 against the true continuation, with
  weights exp(-(k-1)/gamma) that decay with the position k in the block;
- the target's embedding and LM head are shared and frozen; the draft's
  layers, ``fc`` and norms are trained.

Many blocks of one sequence are trained in one forward: every block's queries
score the shared context keys, masked to positions < anchor_j (and >=
anchor_j - window on sliding layers), plus its own block's keys only.
``draft_train_forward`` reuses the draft's own modules (``keys_values`` for
K/V, the same norms and projections), and a test
checks it against the cached inference path block by block.
"""

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .draft import FULL, SLIDING, DFlashDraft, DraftConfig, default_target_layer_ids
from .errors import DFlashError
from .target import Target
from .train_data import (
    SequenceData,
    StreamData,
    corpus_stream,
    greedy_continuations,
    prompt_ids,
    read_records,
    stream_prompts,
)
from .train_loop import OptimConfig, fit, list_checkpoints


@dataclass
class DraftTrainConfig:
    """What to train (the draft's shape) and on what."""

    # draft shape
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
    config = DraftConfig(
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


# ----------------------------------------------------------------------------
# the training forward


def context_mask(anchors: mx.array, seq_len: int, window: Optional[int] = None) -> mx.array:
    """Boolean [B, m, T]: block j sees context positions < anchor_j (and
    >= anchor_j - window on sliding layers)."""
    pos = mx.arange(seq_len)[None, None, :]
    a = anchors[:, :, None]
    mask = pos < a
    if window is not None:
        mask = mask & (pos >= a - window)
    return mask


def _block_attention(q, kc, vc, kb, vb, ctx_mask, scale, causal):
    """Attention of every block over [its context ; itself] (causal inside the
    block when ``causal``).

    q: [B, m, nh, b, hd]; kc, vc: [B, nkv, T, hd] (context, shared by all
    blocks); kb, vb: [B, m, nkv, b, hd] (each block's own keys); ctx_mask:
    [B, m, T]. Scores are split into a context part and a b x b own-block
    part, so no block ever scores another block's keys. Returns [B, m, b, nh*hd].
    """
    B, m, nh, b, hd = q.shape
    nkv, T = kc.shape[1], kc.shape[2]
    rep = nh // nkv
    q = (q * scale).reshape(B, m, nkv, rep, b, hd).transpose(0, 2, 3, 1, 4, 5)  # [B,nkv,rep,m,b,hd]
    kb = kb.transpose(0, 2, 1, 3, 4)[:, :, None]  # [B, nkv, 1, m, b, hd]
    vb = vb.transpose(0, 2, 1, 3, 4)[:, :, None]
    s_ctx = (q.reshape(B, nkv, rep, m * b, hd) @ kc[:, :, None].swapaxes(-1, -2))
    s_ctx = s_ctx.reshape(B, nkv, rep, m, b, T)
    s_ctx = mx.where(ctx_mask[:, None, None, :, None, :], s_ctx, -mx.inf)
    s_blk = q @ kb.swapaxes(-1, -2)  # [B, nkv, rep, m, b, b]
    if causal:
        s_blk = mx.where(mx.tril(mx.ones((b, b), dtype=mx.bool_)), s_blk, -mx.inf)
    p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
    out = (p[..., :T].reshape(B, nkv, rep, m * b, T) @ vc[:, :, None]).reshape(B, nkv, rep, m, b, hd)
    out = out + p[..., T:] @ vb
    return out.transpose(0, 3, 4, 1, 2, 5).reshape(B, m, b, nh * hd)


def draft_train_forward(
    draft: DFlashDraft, block_embeddings: mx.array, features: mx.array, anchors: mx.array
) -> mx.array:
    """Final-normed draft hidden states for many blocks per sequence at once.

    block_embeddings: [B, m*b, H], the target embeddings of the m blocks
    [x_a, mask, ..., mask] concatenated; features: [B, T, k*H] target features
    of every position; anchors: [B, m] int positions of the blocks' first
    token. Equals, block by block, ``inject(features[:, :a])`` followed by
    ``draft(block)`` on a fresh cache: the same modules (``keys_values`` for
    K/V, the same norms, projections and RoPE at absolute positions).
    """
    B, T, _ = features.shape
    m = anchors.shape[1]
    b = block_embeddings.shape[1] // m
    ctx = draft.hidden_norm(draft.fc(features))
    offsets = anchors.reshape(-1)
    masks = {}
    h = block_embeddings
    for layer in draft.layers:
        attn = layer.self_attn
        window = attn.sliding_window
        if window not in masks:
            masks[window] = context_mask(anchors, T, window)
        kc, vc = attn.keys_values(ctx, 0)  # [B, nkv, T, hd] at positions 0..T-1
        x = layer.input_layernorm(h).reshape(B * m, b, -1)
        q = attn.q_norm(attn.q_proj(x).reshape(B * m, b, attn.n_heads, -1))
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offsets)  # [B*m, nh, b, hd]
        kb, vb = attn.keys_values(x, offsets)  # [B*m, nkv, b, hd] at anchor..anchor+b-1
        split = lambda t: t.reshape(B, m, *t.shape[1:])
        out = _block_attention(split(q), kc, vc, split(kb), split(vb), masks[window], attn.scale,
                               attn.causal)
        h = h + attn.o_proj(out.reshape(B, m * b, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


def position_weights(block_size: int, gamma: float) -> mx.array:
    """exp(-(k-1)/gamma) for block positions k = 1..b-1."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def sample_anchors(rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray, m: int, b: int) -> np.ndarray:
    """[B, m] anchors with lo <= a and a + b - 1 < hi, distinct where room allows."""
    out = np.empty((len(lo), m), np.int64)
    for r, (l, h) in enumerate(zip(lo, hi)):
        top = int(h) - b  # last valid anchor
        l = int(l)
        if top < l:  # too short: fall back to the earliest anchor with full labels
            l = top = max(int(h) - b, 0)
        span = top - l + 1
        if span >= m:
            out[r] = np.sort(rng.choice(span, size=m, replace=False)) + l
        else:
            out[r] = np.sort(rng.integers(0, span, size=m)) + l
    return out


class DraftObjective:
    """Batches (from the frozen target) and the weighted block loss."""

    def __init__(self, target: Target, config: DraftConfig, train: DraftTrainConfig, data, seed: int):
        self.target = target
        self.config = config
        self.train = train
        self.data = data
        self.seed = seed
        self.weights = position_weights(config.block_size, train.gamma)
        self.features = None
        if train.cache_features and isinstance(data, SequenceData):
            self.features = self._precompute()

    def _features(self, tokens: mx.array) -> mx.array:
        return self.target.forward(tokens, None, self.config.target_layer_ids).features

    def _precompute(self) -> np.ndarray:
        """Target features of every sequence, once (float16, [N, seq_len, k*H])."""
        n, T = len(self.data), self.train.seq_len
        out = np.zeros((n, T, self.config.feature_size), np.float16)
        t0 = time.perf_counter()
        step = max(self.train.batch_size, 1)
        for start in range(0, n, step):
            idx = np.arange(start, min(start + step, n))
            x, _, _ = self.data.rows(idx, T)
            f = self._features(mx.array(x)).astype(mx.float16)
            out[idx] = np.array(f)
            if (start // step) % 50 == 0:
                _log(f"  target features {start + len(idx)}/{n} "
                     f"({(start + len(idx)) / (time.perf_counter() - t0):.1f} seq/s)")
        _log(f"cached target features for {n} sequences ({out.nbytes / 2**30:.2f} GiB)")
        return out

    def batch(self, step: int, micro: int):
        cfg, b = self.train, self.config.block_size
        rng = np.random.default_rng([self.seed, step, micro])
        if self.features is not None:
            idx = self.data.sample_indices(rng, cfg.batch_size)
            x, lo, hi = self.data.rows(idx, cfg.seq_len)
        else:
            x, lo, hi = self.data.sample(rng, cfg.batch_size, cfg.seq_len)
        anchors = sample_anchors(rng, lo, hi, cfg.blocks_per_seq, b)
        if self.features is not None:
            feats = mx.array(self.features[idx]).astype(mx.float32)
        else:
            feats = self._features(mx.array(x))
        rows = np.arange(len(x))[:, None, None]
        idx_blk = anchors[:, :, None] + np.arange(b)[None, None, :]  # [B, m, b]
        block = x[rows, idx_blk].copy()
        labels = block[:, :, 1:].copy()
        block[:, :, 1:] = self.config.mask_token_id
        emb = self.target.embed(mx.array(block.reshape(len(x), -1)))
        anchors_mx = mx.array(anchors.astype(np.int32))
        mx.eval(feats, emb)
        return emb, feats, anchors_mx, mx.array(labels), int(labels.size)

    def loss(self, draft, emb, feats, anchors, labels):
        hidden = draft_train_forward(draft, emb, feats, anchors)
        B, m = anchors.shape
        b = self.config.block_size
        hidden = hidden.reshape(B, m, b, -1)[:, :, 1:]
        logits = self.target.logits(hidden)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [B, m, b-1]
        w = self.weights
        loss = (ce * w).sum() / (w.sum() * B * m)
        return loss, mx.array(float(B * m))


# ----------------------------------------------------------------------------
# data preparation


def _mask_token_id(tokenizer, target: Target, requested: Optional[int]) -> int:
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


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return sorted(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if eos is not None else []


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _held_out_tokens(n: int, cfg: DraftTrainConfig) -> int:
    """Tokens kept off the end of a corpus for eval prompts (about 2%)."""
    if cfg.eval_prompts <= 0:
        return 0
    return min(max(n // 50, 4 * max(cfg.prompt_lengths)), n // 5)


def prepare_data(
    target: Target, tokenizer, data_paths: Sequence[str], cfg: DraftTrainConfig,
    out_dir: Path, seed: int, eval_prompt_paths: Optional[Sequence[str]] = None,
) -> tuple[object, list[list[int]]]:
    """(training dataset, held-out eval prompts). Self-distilled data is cached in
    ``out_dir/distill.npz`` so a resumed run reuses it."""
    eos = _eos_ids(tokenizer)
    pad = eos[0] if eos else 0
    records = read_records(data_paths)
    rng = np.random.default_rng([seed, 7919])
    eval_prompts: list[list[int]] = []
    if eval_prompt_paths:
        eval_prompts = [
            prompt_ids(tokenizer, r) or tokenizer.encode(r.text)
            for r in read_records(eval_prompt_paths)
        ][: max(cfg.eval_prompts, 0)]
    prompt_records = [r for r in records if prompt_ids(tokenizer, r) is not None]

    if not cfg.self_distill:
        stream = corpus_stream(tokenizer, records, pad)
        n_eval = _held_out_tokens(len(stream), cfg) if not eval_prompts else 0
        train_stream, held = stream[: len(stream) - n_eval], stream[len(stream) - n_eval :]
        if n_eval:
            eval_prompts = stream_prompts(held, cfg.eval_prompts, cfg.prompt_lengths, rng, pad)
        return StreamData(train_stream), eval_prompts

    # self-distillation: prompts -> the target's greedy continuations
    if prompt_records:
        prompts = [prompt_ids(tokenizer, r) for r in prompt_records]
        order = rng.permutation(len(prompts))
        prompts = [prompts[i] for i in order]
        if not eval_prompts and cfg.eval_prompts > 0:
            k = min(cfg.eval_prompts, max(len(prompts) // 10, 1))
            eval_prompts, prompts = prompts[:k], prompts[k:]
        prompts = prompts[: cfg.num_prompts]
    else:
        stream = corpus_stream(tokenizer, records, pad)
        n_eval = _held_out_tokens(len(stream), cfg) if not eval_prompts else 0
        train_stream, held = stream[: len(stream) - n_eval], stream[len(stream) - n_eval :]
        if n_eval:
            eval_prompts = stream_prompts(held, cfg.eval_prompts, cfg.prompt_lengths, rng, pad)
        prompts = stream_prompts(train_stream, cfg.num_prompts, cfg.prompt_lengths, rng, pad)
    if not prompts:
        raise DFlashError("no training prompts left for self-distillation")
    cache = Path(out_dir) / "distill.npz"
    if cache.is_file():
        data = SequenceData.load(cache, pad)
        if len(data) == len(prompts):
            _log(f"reusing {len(data)} self-distilled sequences from {cache}")
            return data, eval_prompts
    _log(f"self-distillation: {len(prompts)} prompts x {cfg.distill_tokens} greedy target tokens")
    t0 = time.perf_counter()

    def progress(done, total):
        rate = done / max(time.perf_counter() - t0, 1e-9)
        _log(f"  distilled {done}/{total} prompts ({rate:.1f}/s)")

    conts = greedy_continuations(
        target.model, prompts, cfg.distill_tokens, eos, cfg.distill_batch, progress
    )
    data = SequenceData([np.array(p + c, np.int32) for p, c in zip(prompts, conts)],
                        [len(p) for p in prompts], pad)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    data.save(cache)
    return data, eval_prompts


# ----------------------------------------------------------------------------
# evaluation and export


def evaluate_tau(model, draft: DFlashDraft, tokenizer, prompts, max_tokens: int, block_size=None) -> dict:
    """Mean acceptance length tau over held-out prompts, with the real loop."""
    from .generate import generate

    lengths = []
    tokens = 0
    t0 = time.perf_counter()
    for p in prompts:
        r = generate(model, draft, tokenizer, list(p), max_tokens=max_tokens, block_size=block_size)
        lengths += r.acceptance_lengths
        tokens += len(r.tokens)
    hist = np.bincount(np.array(lengths, np.int64) - 1, minlength=(block_size or draft.config.block_size))
    return {
        "tau": float(np.mean(lengths)) if lengths else 0.0,
        "cycles": len(lengths),
        "tokens": tokens,
        "accepted_histogram": hist.tolist(),  # index a: cycles that accepted a drafts
        "seconds": time.perf_counter() - t0,
    }


def save_draft(draft: DFlashDraft, path: Path, dtype: Optional[str] = None) -> Path:
    """The MLX layout ``load_draft`` reads (config + model.safetensors), atomically."""
    from mlx_lm.utils import save_config

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(draft.parameters()))
    if dtype:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(draft.config.to_dict(), tmp / "config.json")
    _replace_dir(tmp, path)
    return path


def export_hf(draft: DFlashDraft, path: Path, dtype: str = "bfloat16") -> Path:
    """The z-lab Hugging Face layout (newer config dialect, PyTorch-style
    safetensors), as vLLM and SGLang load DFlash drafts."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    c = draft.config
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(draft.parameters())}
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
    config = {
        **c.to_dict(),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
        "block_size": c.block_size,
    }
    config.pop("quantization", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _replace_dir(tmp, path)
    return path


def _replace_dir(tmp: Path, final: Path) -> None:
    import shutil

    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


# ----------------------------------------------------------------------------
# the entry point


def train_draft(
    model_path: str,
    out_dir: str,
    data: Sequence[str],
    train: Optional[DraftTrainConfig] = None,
    optim_cfg: Optional[OptimConfig] = None,
    *,
    eval_prompt_paths: Optional[Sequence[str]] = None,
    export_hf_dir: Optional[str] = None,
    hf_dtype: str = "bfloat16",
    resume: bool = True,
    stop_after: Optional[int] = None,
    model_and_tokenizer=None,
) -> dict:
    """Train a DFlash draft for the target at ``model_path``; returns a summary.

    Writes ``out_dir/checkpoints/step_*`` (exact resume), ``out_dir/draft``
    (MLX layout, loads with ``load_draft``) and, with ``export_hf_dir``, the
    z-lab Hugging Face layout. ``stop_after`` pauses after that many steps
    (resume later with the same arguments).
    """
    from .loading import load

    train = train or DraftTrainConfig()
    optim_cfg = optim_cfg or OptimConfig()
    optim_cfg.validate()  # before any expensive data preparation
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = model_and_tokenizer or load(model_path)
    model.eval()
    target = Target(model)
    mask_id = _mask_token_id(tokenizer, target, train.mask_token_id)
    config = draft_config_for(target, train, mask_id)
    if train.seq_len <= config.block_size + 1:
        raise DFlashError(f"--seq-len must exceed the block size + 1, got {train.seq_len}")

    meta_file = out / "train_config.json"
    meta = {"target": str(model_path), "draft": config.to_dict(), "train": asdict(train),
            "optim": asdict(optim_cfg), "data": [str(d) for d in data]}
    meta = json.loads(json.dumps(meta))
    if resume and list_checkpoints(out) and meta_file.is_file():
        old = json.loads(meta_file.read_text())
        changed = [k for k in ("draft", "train", "optim") if old.get(k) != meta[k]]
        if changed:
            raise DFlashError(
                f"'{out}' holds checkpoints of a run with different {', '.join(changed)} "
                "settings; use a new --out or --no-resume"
            )
    meta_file.write_text(json.dumps(meta, indent=2))

    dataset, eval_prompts = prepare_data(
        target, tokenizer, data, train, out, optim_cfg.seed, eval_prompt_paths
    )
    mx.random.seed(optim_cfg.seed)
    draft = DFlashDraft(config)
    mx.eval(draft.parameters())
    objective = DraftObjective(target, config, train, dataset, optim_cfg.seed)
    evals = []

    def on_checkpoint(step, path):
        every = train.eval_every
        if every and eval_prompts and (step // max(optim_cfg.checkpoint_every, 1)) % every == 0 \
                and step < optim_cfg.steps:
            r = evaluate_tau(model, draft, tokenizer, eval_prompts, train.eval_tokens)
            evals.append({"step": step, **r})
            _log(f"eval at step {step}: tau {r['tau']:.2f} over {r['cycles']} cycles")

    summary = fit(
        draft, objective.loss, objective.batch, optim_cfg, out,
        resume=resume, extra={"kind": "dflash-draft"}, on_checkpoint=on_checkpoint,
        stop_after=stop_after,
    )
    result = {"step": summary["step"], "losses": summary["losses"], "evals": evals,
              "draft_dir": None, "hf_dir": None}
    if summary["step"] < optim_cfg.steps:
        _log(f"paused at step {summary['step']}/{optim_cfg.steps}; run again to resume")
        return result
    result["draft_dir"] = str(save_draft(draft, out / "draft"))
    _log(f"wrote {result['draft_dir']}")
    if export_hf_dir:
        result["hf_dir"] = str(export_hf(draft, Path(export_hf_dir), hf_dtype))
        _log(f"wrote {result['hf_dir']} (Hugging Face layout, {hf_dtype})")
    if eval_prompts:
        r = evaluate_tau(model, draft, tokenizer, eval_prompts, train.eval_tokens)
        result["final_eval"] = r
        _log(
            f"held-out tau {r['tau']:.2f} at block {config.block_size} over {len(eval_prompts)} "
            f"prompts ({r['cycles']} cycles); accepted-length histogram {r['accepted_histogram']}"
        )
        (out / "eval.json").write_text(json.dumps(r, indent=2))
    return result


def parse_layer_ids(text: Optional[str]) -> Optional[list[int]]:
    """'1,4,7' -> [1, 4, 7]; None or '' -> None (the published default)."""
    if not text:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise DFlashError(f"--target-layer-ids must be comma-separated integers, got '{text}'") from None


def run_cli(
    *, model: str, out: str, data: list[str], self_distill: bool, layers: int,
    target_layer_ids: Optional[str], block_size: int, mask_token_id: Optional[int],
    heads: Optional[int], kv_heads: Optional[int], head_dim: Optional[int],
    intermediate_size: Optional[int], sliding_window: Optional[int], steps: int,
    batch_size: int, seq_len: int, blocks_per_seq: int, gamma: float, lr: float,
    warmup: int, min_lr_ratio: float, weight_decay: float, grad_accum: int, grad_clip: float,
    num_prompts: int, distill_tokens: int, cache_features: bool, eval_prompts: Optional[list[str]], eval_count: int,
    eval_tokens: int, eval_every: int, checkpoint_every: int, seed: int, resume: bool,
    export_hf: Optional[str], hf_dtype: str,
) -> dict:
    """``dflash-mlx train``: build the configs from command-line values and train."""
    if not data:
        raise DFlashError("give training data with --data (text or JSONL files or directories)")
    for name, value in (("--steps", steps), ("--batch-size", batch_size), ("--layers", layers),
                        ("--blocks-per-seq", blocks_per_seq), ("--grad-accum", grad_accum)):
        if value <= 0:
            raise DFlashError(f"{name} must be positive, got {value}")
    if block_size < 2:
        raise DFlashError(f"--block-size must be at least 2, got {block_size}")
    if hf_dtype not in ("bfloat16", "float16", "float32"):
        raise DFlashError(f"--hf-dtype must be bfloat16, float16 or float32, got '{hf_dtype}'")
    train = DraftTrainConfig(
        num_layers=layers, target_layer_ids=parse_layer_ids(target_layer_ids),
        block_size=block_size, mask_token_id=mask_token_id, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        sliding_window=sliding_window, seq_len=seq_len, batch_size=batch_size,
        blocks_per_seq=blocks_per_seq, gamma=gamma, self_distill=self_distill,
        num_prompts=num_prompts, distill_tokens=distill_tokens, cache_features=cache_features,
        eval_prompts=eval_count,
        eval_tokens=eval_tokens, eval_every=eval_every,
    )
    optim_cfg = OptimConfig(
        steps=steps, learning_rate=lr, warmup_steps=min(warmup, steps), min_lr_ratio=min_lr_ratio,
        weight_decay=weight_decay, grad_clip=grad_clip, grad_accum=grad_accum,
        checkpoint_every=checkpoint_every, seed=seed,
    )
    return train_draft(
        model, out, data, train, optim_cfg, eval_prompt_paths=eval_prompts,
        export_hf_dir=export_hf, hf_dtype=hf_dtype, resume=resume,
    )
