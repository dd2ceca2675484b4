"""``dflash-mlx train`` refuses what it cannot finish before it starts, in one
error line, and a run that fails leaves no settings file behind."""


import pytest

from dflash_mlx.errors import DFlashError
from dflash_mlx.train.loop import OptimConfig
from cli_run import cli, one_error_line




@pytest.fixture
def train_args(tmp_path, target_dirs):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog sat on the log\n" * 20)
    return ["train", "--model", target_dirs["qwen3"], "--data", corpus, "--layers", "1", "--block-size", "4",
            "--seq-len", "16", "--batch-size", "1", "--steps", "1", "--warmup", "0", "--eval-count", "0"]


@pytest.mark.parametrize("case, wanted", [
    ("export is out", "would replace --out"),
    ("export is out/draft", "would replace the run's own"),
    ("out is a file", "is not a directory"),
    ("out under /proc", "cannot be written"),
    ("lr nan", "learning_rate must be a positive number"),
])
def test_train_refuses_up_front(tmp_path, train_args, case, wanted):
    out = tmp_path / "run"
    extra = {
        "export is out": ["--out", out, "--export-hf", out],
        "export is out/draft": ["--out", out, "--export-hf", out / "draft"],
        "out is a file": ["--out", tmp_path / "corpus.txt"],
        "out under /proc": ["--out", "/proc/dflash-mlx-run"],
        "lr nan": ["--out", out, "--lr", "nan"],
    }[case]
    one_error_line(cli(*train_args, *extra), wanted)
    assert not out.exists()  # refused before anything was written


def test_a_failed_run_leaves_no_settings_file(tmp_path, train_args):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "run"
    args = [a if a != train_args[4] else empty for a in train_args]  # the --data value
    one_error_line(cli(*args, "--out", out), "holds no text")
    assert not (out / "train_config.json").exists()


@pytest.mark.parametrize("field", ["learning_rate", "min_lr_ratio", "weight_decay", "grad_clip"])
def test_optim_config_refuses_nan(field):
    with pytest.raises(DFlashError, match=field):
        OptimConfig(**{field: float("nan")}).validate()
