"""A small, exactly resumable training loop for MLX models.

Used by ``dflash-mlx train`` (DFlash drafts) and by the demo pair's target
pretraining script. Everything that decides the next update lives in a
checkpoint:

- the trained parameters and the optimizer state (AdamW moments, step, and
  the learning rate, which a warmup + cosine schedule derives from the step);
- the step counter; batches are a pure function of (seed, step, micro-batch),
  so the data position needs no state of its own.

Resuming from a checkpoint therefore continues bit for bit as if the run had
never stopped (on the same machine and library versions).
"""

import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..atomic import staged_output
from ..errors import DFlashError
from .progress import Progress

CHECKPOINT_PREFIX = "step_"


@dataclass
class OptimConfig:
    """Optimizer, schedule and loop settings."""

    steps: int = 1000
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step
    checkpoint_every: int = 100  # steps; 0: only at the end
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0

    def validate(self) -> None:
        if self.steps <= 0:
            raise DFlashError(f"steps must be positive, got {self.steps}")
        if self.grad_accum <= 0:
            raise DFlashError(f"grad_accum must be positive, got {self.grad_accum}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise DFlashError(f"warmup_steps must be in 0..steps, got {self.warmup_steps}")
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            raise DFlashError(f"learning_rate must be a positive number, got {self.learning_rate}")
        for name in ("min_lr_ratio", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise DFlashError(f"{name} must be a non-negative number, got {value}")


def lr_schedule(cfg: OptimConfig) -> Callable:
    """Linear warmup from 0 to ``learning_rate``, then cosine decay to the floor."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    decay = optim.cosine_decay(peak, max(cfg.steps - cfg.warmup_steps, 1), floor)
    if cfg.warmup_steps == 0:
        return decay
    warmup = optim.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optim.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optim.Optimizer:
    return optim.AdamW(
        learning_rate=lr_schedule(cfg),
        betas=[cfg.beta1, cfg.beta2],
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


# ----------------------------------------------------------------------------
# checkpoints


def all_finite(params) -> bool:
    """True if no array in the parameter tree holds NaN or infinity."""
    arrays = [v for _, v in tree_flatten(params)]
    return all(mx.isfinite(v).all().item() for v in arrays)


def kept(out_dir: Path) -> str:
    """What a stopped run leaves to resume from, in words."""
    if list_checkpoints(out_dir):
        return f"the checkpoints in '{Path(out_dir) / 'checkpoints'}' are kept"
    return "no checkpoint had been written yet"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints under ``out_dir/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / "state.json").is_file():
            try:
                found.append((int(p.name[len(CHECKPOINT_PREFIX):]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found)]


def save_checkpoint(
    out_dir: Path, model: nn.Module, optimizer: optim.Optimizer, step: int,
    extra: dict, keep: int = 2,
) -> Path:
    """Write trainable parameters, optimizer state and ``extra`` (JSON) atomically,
    then drop all but the newest ``keep`` checkpoints.

    Non-finite parameters are refused: the checkpoints already there stay.
    """
    final = Path(out_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"
    params = dict(tree_flatten(model.trainable_parameters()))
    if not all_finite(params):
        raise DFlashError(
            f"the weights became NaN or infinite at step {step}: training diverged; stopped "
            f"without saving, {kept(out_dir)} (lower the learning rate)"
        )
    with staged_output(final, force=True) as tmp:
        tmp.mkdir()
        mx.save_safetensors(str(tmp / "model.safetensors"), params)
        opt_state = dict(tree_flatten(optimizer.state))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
        (tmp / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2))
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: optim.Optimizer) -> dict:
    """Restore a checkpoint into ``model`` and ``optimizer``; return its state.json."""
    path = Path(path)
    try:
        params = mx.load(str(path / "model.safetensors"))
        opt_state = mx.load(str(path / "optimizer.safetensors"))
        state = json.loads((path / "state.json").read_text())
    except Exception as e:
        raise DFlashError(f"cannot read checkpoint '{path}': {e}") from None
    model.load_weights(list(params.items()), strict=False)
    optimizer.state = tree_unflatten(list(opt_state.items()))
    mx.eval(model.parameters(), optimizer.state)
    return state


# ----------------------------------------------------------------------------
# the loop


LossFn = Callable[..., tuple[mx.array, mx.array]]  # (model, *batch) -> (mean loss, weight)


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    batch_fn: Callable[[int, int], tuple],
    cfg: OptimConfig,
    out_dir: Path,
    *,
    resume: bool = True,
    extra: Optional[dict] = None,
    on_checkpoint: Optional[Callable[[int, Path], None]] = None,
    stop_after: Optional[int] = None,
    stream=None,
) -> dict:
    """Train ``model`` for ``cfg.steps`` optimizer steps.

    ``batch_fn(step, micro)`` returns the arguments of ``loss_fn`` after the
    model, plus as its last element the number of tokens it holds (for tok/s);
    it must be a pure function of its arguments so that resuming is exact.
    ``loss_fn(model, *args)`` returns (mean loss, weight): micro-batch
    gradients are combined weighted by ``weight`` (e.g. the number of target
    tokens). ``stop_after`` ends the run early after that many steps in this
    call (the schedule still spans ``cfg.steps``). Returns a summary dict.
    """
    cfg.validate()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(cfg)
    schedule = lr_schedule(cfg)
    extra = {"optim": asdict(cfg), **(extra or {})}
    step = 0
    existing = list_checkpoints(out_dir)
    progress_stream = stream or sys.stderr
    if existing and not resume:
        for path in existing:
            shutil.rmtree(path)
        progress_stream.write(f"starting over: removed {len(existing)} checkpoints of an "
                              f"earlier run in {existing[0].parent}\n")
        existing = []
    if existing:
        state = load_checkpoint(existing[-1], model, optimizer)
        step = int(state["step"])
        progress_stream.write(f"resuming from {existing[-1]} (step {step})\n")
    else:
        optimizer.init(model.trainable_parameters())

    def weighted(model, *args):
        loss, weight = loss_fn(model, *args)
        return loss * weight, (loss, weight)

    grad_fn = nn.value_and_grad(model, weighted)
    progress = Progress(cfg.steps, step, progress_stream, cfg.log_every)
    history = []
    ran = 0
    last_ckpt = None
    try:
        while step < cfg.steps:
            grads, total_loss, total_weight, tokens = None, 0.0, 0.0, 0
            for micro in range(cfg.grad_accum):
                *args, ntok = batch_fn(step, micro)
                (_, (loss, weight)), g = grad_fn(model, *args)
                grads = g if grads is None else tree_map(mx.add, grads, g)
                mx.eval(grads, loss, weight)
                total_loss += loss.item() * weight.item()
                total_weight += weight.item()
                tokens += int(ntok)
            mean_loss = total_loss / max(total_weight, 1e-12)
            if not math.isfinite(mean_loss):
                raise DFlashError(
                    f"the loss is {mean_loss} at step {step + 1}: training diverged; stopped before "
                    f"that update, {kept(out_dir)} (lower the learning rate, or check the data)"
                )
            grads = tree_map(lambda g: g / total_weight, grads)
            if cfg.grad_clip > 0:
                grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            lr = schedule(step).item()  # what this update uses
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state)
            step += 1
            ran += 1
            history.append(mean_loss)
            progress.update(step, mean_loss, tokens, lr)
            done = step == cfg.steps or (stop_after is not None and ran >= stop_after)
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or done:
                last_ckpt = save_checkpoint(out_dir, model, optimizer, step, extra, cfg.keep_checkpoints)
                if on_checkpoint is not None:
                    on_checkpoint(step, last_ckpt)
            if done:
                break
    finally:
        progress.close()
    return {"step": step, "losses": history, "checkpoint": last_ckpt}
