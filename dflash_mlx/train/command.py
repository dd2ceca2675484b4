"""``dflash-mlx train``: from command-line values to a trained, exported draft.

``train_draft`` ties the pieces together: the target, the draft's config
(``config``), the data (``data``), the objective (``objective``), the loop
with its checkpoints (``loop``), held-out evaluation (``evaluate``) and the
written draft (``export``).
"""

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Optional, Sequence

import mlx.core as mx

from .. import validate
from ..atomic import check_output, write_text
from ..errors import DFlashError
from ..targets import Target
from .config import ARCHS, DraftTrainConfig, draft_config_for, mask_token_id
from .data import prepare_data
from .dflash2 import initial_draft
from .dspark import DSparkObjective
from .evaluate import evaluate_tau
from .export import export_hf, save_draft
from .loop import OptimConfig, fit, list_checkpoints
from .objective import DraftObjective
from .progress import log


def _check_resumable(out: Path, meta: dict, resume: bool) -> None:
    """Refuse to resume the checkpoints in ``out`` with other settings or data."""
    meta_file = out / "train_config.json"
    if not (resume and list_checkpoints(out) and meta_file.is_file()):
        return
    try:
        old = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read '{meta_file}' ({e}); use a new --out or --no-resume") from None
    changed = [k for k in ("draft", "train", "optim", "data") if old.get(k) != meta[k]]
    if changed:
        raise DFlashError(
            f"'{out}' holds checkpoints of a run with different {', '.join(changed)} "
            "settings; use a new --out or --no-resume"
        )


def check_out_dir(out: Path) -> None:
    """DFlashError unless ``out`` is, or can be made as, a writable directory."""
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out '{out}' exists and is not a directory; choose another")
    validate.writable(out, "--out")


def check_export_dir(export: Path, out: Path) -> None:
    """DFlashError if writing ``export`` would replace the run: --out itself, a
    parent of it, or its MLX draft or checkpoints."""
    real, run = export.expanduser().resolve(), out.resolve()
    if real == run or real in run.parents:
        raise DFlashError(f"--export-hf '{export}' would replace --out '{out}' (the run's checkpoints and "
                          "MLX draft); choose another folder")
    for own in (run / "draft", run / "checkpoints"):
        if real == own or own in real.parents:
            raise DFlashError(f"--export-hf '{export}' would replace the run's own '{own}'; "
                              "choose a folder outside it")


@contextlib.contextmanager
def settings_file(out: Path, meta: dict) -> Iterator[None]:
    """Write the run's settings (``train_config.json``, what a resume checks)
    for the block; removed if the block fails before any checkpoint exists."""
    write_text(out / "train_config.json", json.dumps(meta, indent=2))
    try:
        yield
    except BaseException:
        if not list_checkpoints(out):
            (out / "train_config.json").unlink(missing_ok=True)
        raise


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
    z-lab Hugging Face layout (DeepSpec's for ``arch="dspark"``). ``stop_after`` pauses after that many steps
    (resume later with the same arguments). Resuming a run of other settings
    or data is refused; ``resume=False`` starts over in ``out_dir``.
    """
    from ..loading import load

    train = train or DraftTrainConfig()
    optim_cfg = optim_cfg or OptimConfig()
    optim_cfg.validate()  # before any expensive data preparation
    out = Path(out_dir).expanduser()
    check_out_dir(out)
    if export_hf_dir:  # before training, not after it
        check_export_dir(Path(export_hf_dir), out)
        check_output(Path(export_hf_dir), force=True)
    model, tokenizer = model_and_tokenizer or load(model_path)
    model.eval()
    target = Target(model)
    mask_id = mask_token_id(tokenizer, target, train.mask_token_id)
    config = draft_config_for(target, train, mask_id)
    if train.seq_len <= config.block_size + 1:
        raise DFlashError(f"--seq-len must exceed the block size + 1, got {train.seq_len}")

    meta = {"target": str(model_path), "draft": config.to_dict(), "train": train.settings(),
            "optim": asdict(optim_cfg), "data": [str(Path(d).expanduser().resolve()) for d in data]}
    _check_resumable(out, json.loads(json.dumps(meta)), resume)
    out.mkdir(parents=True, exist_ok=True)
    with settings_file(out, meta):
        dataset, eval_prompts = prepare_data(
            target, tokenizer, data, train, out, optim_cfg.seed, eval_prompt_paths, reuse_cache=resume
        )
        mx.random.seed(optim_cfg.seed)
        draft = initial_draft(config)
        objective = (DSparkObjective if train.arch == "dspark" else DraftObjective)(
            target, config, train, dataset, optim_cfg.seed)
        evals = []

        def on_checkpoint(step, path):
            every = train.eval_every
            if every and eval_prompts and (step // max(optim_cfg.checkpoint_every, 1)) % every == 0 \
                    and step < optim_cfg.steps:
                r = evaluate_tau(model, draft, tokenizer, eval_prompts, train.eval_tokens)
                evals.append({"step": step, **r})
                log(f"eval at step {step}: tau {r['tau']:.2f} over {r['cycles']} cycles")

        summary = fit(
            draft, objective.loss, objective.batch, optim_cfg, out,
            resume=resume, extra={"kind": "dflash-draft"}, on_checkpoint=on_checkpoint,
            stop_after=stop_after,
        )
        result = {"step": summary["step"], "losses": summary["losses"], "evals": evals,
                  "draft_dir": None, "hf_dir": None}
        if summary["step"] < optim_cfg.steps:
            log(f"paused at step {summary['step']}/{optim_cfg.steps}; run again to resume")
            return result
        result["draft_dir"] = str(save_draft(draft, out / "draft"))
        log(f"wrote {result['draft_dir']}")
        if export_hf_dir:
            result["hf_dir"] = str(export_hf(draft, Path(export_hf_dir), hf_dtype, target))
            log(f"wrote {result['hf_dir']} (Hugging Face layout, {hf_dtype})")
        if eval_prompts:
            r = evaluate_tau(model, draft, tokenizer, eval_prompts, train.eval_tokens)
            result["final_eval"] = r
            log(
                f"held-out tau {r['tau']:.2f} at block {config.block_size} over {len(eval_prompts)} "
                f"prompts ({r['cycles']} cycles); accepted-length histogram {r['accepted_histogram']}"
            )
            write_text(out / "eval.json", json.dumps(r, indent=2))
        return result


def parse_ints(text: str, option: str, count: Optional[int] = None) -> list[int]:
    """'2,16' -> [2, 16]; with ``count``, exactly that many integers."""
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        values = None
    if values is None or count not in (None, len(values)):
        how_many = f"{count} " if count else ""
        raise DFlashError(f"{option} takes {how_many}comma-separated integers, got '{text}'")
    return values


def parse_layer_ids(text: Optional[str]) -> Optional[list[int]]:
    """'1,4,7' -> [1, 4, 7]; None or '' -> None (the published default)."""
    return parse_ints(text, "--target-layer-ids") if text else None


def run_cli(
    *, given: set[str], model: str, out: str, data: list[str], self_distill: bool, layers: int,
    target_layer_ids: Optional[str], block_size: int, mask_token_id: Optional[int],
    heads: Optional[int], kv_heads: Optional[int], head_dim: Optional[int],
    intermediate_size: Optional[int], sliding_window: Optional[int], arch: str, conv: str,
    selector: str, selector_weight: float, markov_rank: int, steps: int,
    batch_size: int, seq_len: int, blocks_per_seq: int, gamma: float, lr: float,
    warmup: int, min_lr_ratio: float, weight_decay: float, grad_accum: int, grad_clip: float,
    num_prompts: int, distill_tokens: int, cache_features: bool, eval_prompts: Optional[list[str]], eval_count: int,
    eval_tokens: int, eval_every: int, checkpoint_every: int, seed: int, resume: bool,
    export_hf: Optional[str], hf_dtype: str,
) -> dict:
    """``dflash-mlx train``: build the configs from command-line values and train;
    ``given``: the options typed, so that one its run would ignore is refused."""
    if not data:
        raise DFlashError("give training data with --data (text or JSONL files or directories)")
    for flags, needed, present in ((("--conv", "--selector", "--selector-weight"), "--arch dflash2", arch == "dflash2"),
                                   (("--markov-rank",), "--arch dspark", arch == "dspark"),
                                   (("--num-prompts", "--distill-tokens", "--cache-features"), "--self-distill",
                                    self_distill),
                                   (("--eval-prompts", "--eval-tokens", "--eval-every"), "--eval-count of 1 or more",
                                    eval_count > 0),
                                   (("--hf-dtype",), "--export-hf", export_hf is not None),
                                   (("--sliding-window",), "--layers of 2 or more", layers > 1)):
        validate.needs(given, flags, needed, present)
    conv_kernel_size, conv_group_size = parse_ints(conv, "--conv", 2)
    selector_rank, selector_top_k = parse_ints(selector, "--selector", 2)
    for name, value in (("--steps", steps), ("--batch-size", batch_size), ("--layers", layers),
                        ("--blocks-per-seq", blocks_per_seq), ("--grad-accum", grad_accum),
                        ("--conv's K", conv_kernel_size), ("--conv's GS", conv_group_size),
                        ("--selector's R", selector_rank)):
        if value <= 0:
            raise DFlashError(f"{name} must be positive, got {value}")
    validate.integer(selector_top_k, "--selector's k", low=2)  # one candidate leaves nothing to select
    validate.integer(markov_rank, "--markov-rank", low=0)  # 0: no Markov head
    if sliding_window is not None:
        validate.integer(sliding_window, "--sliding-window", low=1)
    if block_size < 2:
        raise DFlashError(f"--block-size must be at least 2, got {block_size}")
    if arch not in ARCHS:
        raise DFlashError(f"--arch must be {', '.join(ARCHS[:-1])} or {ARCHS[-1]}, got '{arch}'")
    if not selector_weight >= 0 or not math.isfinite(selector_weight):
        raise DFlashError(f"--selector-weight must be a non-negative number, got {selector_weight}")
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
        eval_tokens=eval_tokens, eval_every=eval_every, arch=arch, conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size, selector_rank=selector_rank, selector_top_k=selector_top_k,
        selector_weight=selector_weight, markov_rank=markov_rank,
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
