"""The Python API and the bench command refuse bad input in one clear line:
objects of the wrong kind, a target without a tokenizer, a damaged ranking
only when it is used, a prompt past the context said once in our words, bench
outputs that cannot be written and empty option lists."""

import json
import shutil
import warnings

import pytest

from dflash_mlx import generate, load, load_draft
from dflash_mlx.draft import RANKING_FILE
from dflash_mlx.errors import DFlashError
from dflash_mlx.validate import LongPromptWarning
from cli_run import cli


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, tokenizer = load(str(target_dirs["qwen3"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3")))


@pytest.mark.parametrize("case, wanted", [
    ("cost_curve", "cost_curve must be a CostCurve"),
    ("draft None", "draft must be a DFlash draft"),
    ("target as draft", "draft must be a DFlash draft from dflash_mlx.load_draft, got mlx_lm.models.qwen3.Model"),
    ("tokenizer None", "tokenizer must be the target's tokenizer"),
    ("model None", "model must be a target model"),
])
def test_objects_of_the_wrong_kind_are_one_line_errors(pair, case, wanted):
    model, tokenizer, draft = pair
    args, kwargs = [model, draft, tokenizer, "hello"], {}
    if case == "cost_curve":
        kwargs["cost_curve"] = "fast"
    else:
        index = {"draft None": 1, "target as draft": 1, "tokenizer None": 2, "model None": 0}[case]
        args[index] = model if case == "target as draft" else None
    with pytest.raises(DFlashError, match=wanted) as e:
        generate(*args, max_tokens=2, **kwargs)
    assert "\n" not in str(e.value)


def test_a_target_without_a_tokenizer_says_so(tmp_path, target_dirs):
    bare = tmp_path / "bare"
    shutil.copytree(target_dirs["qwen3"], bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(DFlashError, match="has no tokenizer"):
        load(str(bare))


def test_a_damaged_ranking_stops_only_draft_vocab(tmp_path, pair, draft_dir):
    model, tokenizer, _ = pair
    folder = tmp_path / "draft"
    shutil.copytree(draft_dir("qwen3"), folder)
    (folder / RANKING_FILE).write_bytes(b"not safetensors")
    draft = load_draft(str(folder))
    assert generate(model, draft, tokenizer, "hello", max_tokens=4, block_size=4).tokens
    with pytest.raises(DFlashError, match="is not a draft vocabulary ranking"):
        generate(model, draft, tokenizer, "hello", max_tokens=4, block_size=4, draft_vocab=8)


def test_a_prompt_past_the_context_is_one_warning_in_our_words(tmp_path, target_dirs, pair, capfd):
    _, _, draft = pair
    short = tmp_path / "short"
    shutil.copytree(target_dirs["qwen3"], short)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((short / name).read_text())
        config[key] = 32
        (short / name).write_text(json.dumps(config))
    model, tokenizer = load(str(short))
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, draft, tokenizer, "hello world " * 30, max_tokens=2, block_size=4)
    long_prompt = [w for w in caught if issubclass(w.category, LongPromptWarning)]
    assert len(long_prompt) == 1 and "more than the target's context length of 32" in str(long_prompt[0].message)
    assert "Token indices sequence length" not in capfd.readouterr().err  # not transformers' too



@pytest.mark.parametrize("args, wanted", [
    (["--json", "/proc/dflash-mlx-bench.json"], "--json '/proc/dflash-mlx-bench.json' cannot be written"),
    (["-b", ","], "names nothing"),
])
def test_bench_refuses_before_loading(args, wanted):
    run = cli("bench", "--max-tokens", "2", *args)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], run.stderr


def test_the_cli_says_a_long_prompt_in_one_warning_line(tmp_path, target_dirs, draft_dir):
    short = tmp_path / "short"
    shutil.copytree(target_dirs["qwen3"], short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(config))
    out = cli("generate", "--model", short, "--draft", draft_dir("qwen3"), "--no-chat-template",
              "-n", 2, "-b", 4, "--prompt", "hello world " * 30)
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "context length of 32" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), out.stderr
    assert "warnings.warn" not in out.stderr and ".py:" not in out.stderr
