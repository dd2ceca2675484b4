"""An option that would do nothing in the chosen mode is refused in one
``error:`` line (exit status 1), never accepted and ignored; refused before any
model loads or any file is written."""

import json
import os

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app


def refused(args, wanted, cwd=None):
    done = CliRunner().invoke(app, [str(a) for a in args])
    lines = done.stderr.strip().splitlines()
    assert done.exit_code == 1, done.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], done.stderr
    assert "Traceback" not in done.output


TRAIN_ONLY_WITH = [
    (["--conv", "2,16"], "--conv does nothing without --arch dflash2"),
    (["--selector", "64,8", "--selector-weight", "0.5"], "--selector, --selector-weight do nothing without --arch dflash2"),
    (["--markov-rank", "64"], "--markov-rank does nothing without --arch dspark"),
    (["--arch", "dflash2", "--markov-rank", "64"], "--markov-rank does nothing without --arch dspark"),
    (["--num-prompts", "10"], "--num-prompts does nothing without --self-distill"),
    (["--distill-tokens", "10", "--cache-features"], "--distill-tokens, --cache-features do nothing without --self-distill"),
    (["--eval-count", "0", "--eval-tokens", "8", "--eval-every", "2"], "--eval-tokens, --eval-every do nothing without"),
    (["--eval-count", "0", "--eval-prompts", "p.txt"], "--eval-prompts does nothing without --eval-count"),
    (["--hf-dtype", "float16"], "--hf-dtype does nothing without --export-hf"),
    (["--sliding-window", "8"], "--sliding-window does nothing without --layers of 2 or more"),
]


@pytest.mark.parametrize("extra, wanted", TRAIN_ONLY_WITH)
def test_train_refuses_options_its_run_would_ignore(tmp_path, extra, wanted):
    out = tmp_path / "run"
    refused(["train", "--model", tmp_path / "nowhere", "--out", out, "--data", tmp_path / "x.txt", *extra], wanted)
    assert not out.exists()


@pytest.mark.parametrize("selector, wanted", [
    ("64,1", "--selector's k must be >= 2, got 1"),
    ("0,8", "--selector's R must be positive"),
])
def test_train_refuses_a_selector_that_cannot_select(tmp_path, selector, wanted):
    refused(["train", "--model", tmp_path / "nowhere", "--out", tmp_path / "run", "--data", tmp_path / "x.txt",
             "--arch", "dflash2", "--selector", selector], wanted)


def test_train_refuses_more_selector_candidates_than_the_vocabulary(tmp_path, target_dirs):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 20)
    out = tmp_path / "run"
    refused(["train", "--model", target_dirs["qwen3"], "--out", out, "--data", corpus, "--arch", "dflash2",
             "--conv", "2,8", "--selector", "8,600", "--steps", "1", "--eval-count", "0"],
            "the target's vocabulary of 512 tokens")
    assert not (out / "train_config.json").exists()  # refused before the settings were written


BENCH_UNUSED = [
    (["--predict", "--preset", "qwen3.5-9b", "--plot", "p.png"], "leave out --plot: bench --predict does not use it"),
    (["--predict", "--preset", "qwen3.5-9b", "--link-gbs", "5"], "--link-gbs does nothing without --machines"),
    (["--predict", "--preset", "qwen3.5-9b", "--link", "tb4-ring", "--link-latency-us", "9"],
     "--link, --link-latency-us do nothing without --machines"),
    (["--link-gbs", "5"], "--link-gbs does nothing without --machines"),
    (["--predict", "--preset", "qwen3.5-9b", "--machines", "2", "--overhead-ms", "1"],
     "leave out --overhead-ms: bench --predict --machines does not use it"),
    (["--predict", "--preset", "qwen3.5-9b", "--machines", "2", "--neural-accelerators"],
     "leave out --neural-accelerators"),
    (["--predict", "--preset", "qwen3.5-9b", "-n", "64", "--temp", "0.5"],
     "leave out --max-tokens, --temp: bench --predict does not use them"),
    (["--predict", "--preset", "qwen3.5-9b", "--kv-group-size", "32"], "--kv-group-size does nothing without --kv-bits"),
    (["--calibrate", "--json", "c.json"], "leave out --json: bench --calibrate does not use it"),
    (["--synthetic", "--plot", "s.png", "-m", "x"], "leave out --model, --plot: bench --synthetic does not use them"),
    (["--concurrency", "2", "--top-p", "0.5"], "leave out --top-p: bench --concurrency does not use it"),
    (["--predict", "--preset", "qwen3.5-9b", "--concurrency", "2", "--no-warmup"], "leave out --warmup/--no-warmup"),
    (["-m", "x", "--chip", "M1"], "leave out --chip: a measured bench run does not use it"),
]


@pytest.mark.parametrize("args, wanted", BENCH_UNUSED)
def test_bench_refuses_options_its_mode_would_ignore(tmp_path, monkeypatch, args, wanted):
    monkeypatch.chdir(tmp_path)  # any relative output path would land here
    refused(["bench", *args], wanted)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode, flag", [([], "--json"), ([], "--plot"), (["--predict", "--preset", "qwen3.5-9b"], "--json")])
def test_bench_refuses_an_empty_output_path(tmp_path, mode, flag):
    refused(["bench", "-m", tmp_path / "nowhere", *mode, flag, ""], f"{flag} needs a file name")


def test_bench_predict_writes_its_json_where_asked(tmp_path):
    out = tmp_path / "p.json"
    done = CliRunner().invoke(app, ["bench", "--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text())["predictions"]


def test_convert_refuses_a_group_size_without_quantizing(tmp_path):
    refused(["convert", tmp_path / "nowhere", "--out", tmp_path / "out", "--q-group-size", "32"],
            "--q-group-size does nothing without --quantize, --q-bits or --recipe")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("extra, wanted", [
    (["--kv-group-size", "32"], "--kv-group-size does nothing without --kv-bits"),
    (["--quantized-kv-start", "10"], "--quantized-kv-start does nothing without --kv-bits"),
])
def test_generate_and_serve_refuse_kv_tuning_without_kv_bits(command, extra, wanted):
    refused([command, *extra, *(["--prompt", "x"] if command == "generate" else [])], wanted)
