"""Nothing of the user's is lost: `convert --force` replaces only its own output
and never the current directory or the source, a killed conversion's staging
directory is removed by the next run, and training that diverges stops with
one error line, keeps its checkpoints and exports nothing non-finite.

Everything runs through the real entry point, ``python -m dflash_mlx``.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import WORDS, write_draft, write_target

from dflash_mlx import load_draft
from dflash_mlx.atomic import MARKER, staged_file, staging_path


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dflash_mlx", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def assert_one_error(result, *words):
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> contents)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def partial_dirs(root: Path) -> list[Path]:
    """Staging directories left anywhere under ``root``."""
    return [p for p in root.rglob("*") if p.name.endswith(".dflash-partial")]


def poison(weights_file: Path) -> None:
    """Flip one weight to NaN, as a corrupted checkpoint would hold."""
    weights = mx.load(str(weights_file))
    name = sorted(weights)[0]
    values = np.array(weights[name])
    values.flat[0] = np.nan
    weights[name] = mx.array(values)
    mx.save_safetensors(str(weights_file), weights)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    target = write_target(root / "target", "qwen3_5")
    write_draft(root / "draft", target, dtype="bfloat16")
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[i : i + 8]) for i in rng.integers(0, 100, 200)]
    (root / "a.txt").write_text("\n".join(lines) + "\n")
    (root / "b.txt").write_text("\n".join(reversed(lines)) + "\n")
    return root


# convert --force --------------------------------------------------------------


def test_force_refuses_a_directory_that_is_not_a_dflash_output(models, tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_text("precious")
    before = files(tmp_path)
    result = cli("convert", models / "draft", "--out", out, "--force")
    assert_one_error(result, "not a dflash-mlx output")
    assert files(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["photos"]


@pytest.mark.parametrize("where", [".", "..", "source", "source-parent"])
def test_force_never_replaces_the_current_directory_the_source_or_their_parents(models, tmp_path, where):
    work = tmp_path / "work"
    shutil.copytree(models / "draft", work)  # looks like ours: only the rule protects it
    src = tmp_path / "src" / "draft"
    shutil.copytree(models / "draft", src)
    out = {".": ".", "..": "..", "source": src, "source-parent": src.parent}[where]
    before = files(tmp_path)
    result = cli("convert", src, "--out", out, "--force", cwd=work)
    assert_one_error(result, "choose another")
    assert files(tmp_path) == before and not partial_dirs(tmp_path)


def test_force_replaces_its_own_earlier_output(models, tmp_path):
    out = tmp_path / "out"
    assert cli("convert", models / "draft", "--out", out).returncode == 0
    assert (out / MARKER).is_file()
    (out / "old-shard.safetensors").write_text("stale")
    assert_one_error(cli("convert", models / "draft", "--out", out), "already exists", "--force")
    result = cli("convert", models / "draft", "--out", out, "--force", "--q-bits", "8")
    assert result.returncode == 0, result.stderr
    assert not (out / "old-shard.safetensors").exists() and load_draft(str(out)).fc.bits == 8
    assert sorted(os.listdir(tmp_path)) == ["out"]


# a killed conversion ----------------------------------------------------------


def test_a_killed_conversion_is_cleaned_up_by_the_next_run(tmp_path):
    # about 30 MB of bf16 weights (fc is 2048 x 6144), quantized: long enough to kill mid-write
    src = tmp_path / "big"
    write_draft(src, {"hidden_size": 2048, "num_hidden_layers": 6, "vocab_size": 512},
                dtype="bfloat16", target_layer_ids=[1, 3, 5])
    out = tmp_path / "out"
    staging = staging_path(out)
    assert staging == tmp_path / ".out.dflash-partial"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_mlx", "convert", str(src), "--out", str(out),
                             "--q-bits", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not staging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    assert staging.is_dir() and not out.exists(), "the kill did not land while the output was written"

    result = cli("convert", src, "--out", out, "--q-bits", "4")
    assert result.returncode == 0, result.stderr
    assert f"removed '{staging}', a partial output left by an interrupted run" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["big", "out"]
    assert load_draft(str(out)).fc.bits == 4


def test_an_output_moved_aside_by_a_killed_run_is_put_back(models, tmp_path):
    out = tmp_path / "out"
    assert cli("convert", models / "draft", "--out", out).returncode == 0
    old = files(out)
    staging = staging_path(out)  # killed between moving `out` aside and renaming the new one in
    (staging / "out").mkdir(parents=True)
    (staging / "out" / "part-00001.safetensors").write_text("half")
    out.rename(staging / "replaced")
    result = cli("convert", models / "draft", "--out", out, "--q-bits", "8")
    assert_one_error(result, "already exists", "--force")
    assert f"restored '{out}'" in result.stderr and f"removed '{staging}'" in result.stderr
    assert files(out) == old and sorted(os.listdir(tmp_path)) == ["out"]


def test_non_finite_tensors_are_reported(models, tmp_path):
    src = tmp_path / "draft"
    shutil.copytree(models / "draft", src)
    weights = mx.load(str(src / "model.safetensors"))
    fc = np.array(weights["fc.weight"].astype(mx.float32))
    fc.flat[:3] = [np.nan, np.inf, -np.inf]
    weights["fc.weight"] = mx.array(fc).astype(mx.bfloat16)
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    result = cli("convert", src, "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "NaN" in line]
    assert warnings == [f"warning: tensor 'fc.weight' holds 3 NaN or infinite values of {fc.size}"]


# training ---------------------------------------------------------------------


def train(models, out, *extra, data="a.txt"):
    return cli("train", "--model", models / "target", "--out", out, "--data", models / data,
               "--layers", "1", "--block-size", "4", "--seq-len", "16", "--batch-size", "2",
               "--blocks-per-seq", "2", "--warmup", "0", "--checkpoint-every", "1",
               "--eval-count", "0", *extra)


def test_a_diverging_run_stops_at_the_first_bad_step_and_writes_no_draft(models, tmp_path):
    result = train(models, tmp_path / "run", "--steps", "6", "--lr", "1e6",
                   "--export-hf", tmp_path / "hf")
    line = assert_one_error(result, "training diverged")
    step = int(line.split(" at step ")[1].split(":")[0])
    kept = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert kept and kept[-1] == f"step_{step - 1:08d}"  # everything up to the last good step
    for name in kept:
        weights = mx.load(str(tmp_path / "run" / "checkpoints" / name / "model.safetensors"))
        assert all(mx.isfinite(w).all().item() for w in weights.values()), name
    assert not (tmp_path / "run" / "draft").exists() and not (tmp_path / "hf").exists()
    assert not partial_dirs(tmp_path)


def test_a_corrupted_checkpoint_stops_resuming_and_is_never_exported(models, tmp_path):
    run = tmp_path / "run"
    assert train(models, run, "--steps", "2").returncode == 0
    draft = files(run / "draft")
    poison(run / "checkpoints" / "step_00000002" / "model.safetensors")
    # finished run: nothing to train, and the poisoned weights are not exported
    assert_one_error(train(models, run, "--steps", "2"), "NaN or infinite", "not written")
    assert files(run / "draft") == draft
    # paused run: the first step's loss is NaN; the checkpoint stays as it was
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    poison(run / "checkpoints" / "step_00000001" / "model.safetensors")
    kept = files(run / "checkpoints")
    assert_one_error(train(models, run, "--steps", "2"), "the loss is nan at step 2")
    assert files(run / "checkpoints") == kept and files(run / "draft") == draft
    assert not partial_dirs(tmp_path)


def test_export_hf_refuses_a_directory_that_is_not_ours_before_training(models, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "notes.txt").write_text("mine")
    before = files(tmp_path)
    assert_one_error(train(models, tmp_path / "run", "--steps", "2", "--export-hf", hf),
                     "not a dflash-mlx output")
    assert files(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_failed_file_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "train_config.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged_file(path) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["train_config.json"]


def test_resuming_with_other_data_is_refused_unless_starting_over(models, tmp_path):
    run = tmp_path / "run"
    assert train(models, run, "--steps", "2").returncode == 0
    config = (run / "train_config.json").read_bytes()
    assert_one_error(train(models, run, "--steps", "2", data="b.txt"), "different data", "--no-resume")
    assert (run / "train_config.json").read_bytes() == config
    result = train(models, run, "--steps", "2", "--no-resume", data="b.txt")
    assert result.returncode == 0, result.stderr
    assert "removed 2 checkpoints of an earlier run" in result.stderr
    assert json.loads((run / "train_config.json").read_text())["data"] == [str((models / "b.txt").resolve())]
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000001", "step_00000002"]
