"""DDTree on the public surface: the tree_budget argument and its checks."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from dflash_mlx import generate, load_draft, stream_generate, validate
from dflash_mlx.errors import DFlashError


def test_tree_budget_zero_or_none_is_the_chain_and_a_positive_int_is_kept():
    assert validate.tree_budget(None, 4096) is None
    assert validate.tree_budget(0, 4096) is None
    assert validate.tree_budget(1, 4096) == 1
    assert validate.tree_budget(4096, 4096) == 4096
    assert validate.tree_budget(10**6, None) == 10**6


@pytest.mark.parametrize("value,message", [
    (-1, "tree_budget must be positive"),
    (4097, "at most the target's context length 4096"),
    (2.0, "tree_budget must be an integer"),
    (True, "tree_budget must be an integer"),
    ("8", "tree_budget must be an integer"),
])
def test_a_bad_tree_budget_is_one_line_error(value, message):
    with pytest.raises(DFlashError, match=message) as e:
        validate.tree_budget(value, 4096)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3_5", block_size=8)))


def test_generate_with_a_tree_budget_is_mlx_lm_greedy(pair):
    model, tokenizer, draft = pair
    prompt = "write a short story about a cat who"
    want = [t for t, _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=40)]
    result = generate(model, draft, tokenizer, prompt, max_tokens=40, tree_budget=12)
    assert result.tokens == want
    assert result.finish_reason == "length"
    assert sum(result.acceptance_lengths) == len(result.tokens) - 1  # tokens per cycle, as the chain reports
    responses = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=40, tree_budget=12, block_size=4))
    assert [t for r in responses for t in r.tokens] == want  # a 4-block tree is at most 3 deep
    assert all(r.accepted <= 3 for r in responses)


def test_a_seed_reproduces_sampling_over_a_tree(pair):
    model, tokenizer, draft = pair
    runs = [generate(model, draft, tokenizer, "hello", max_tokens=16, tree_budget=8, temperature=0.8, seed=s)
            for s in (5, 5, 6)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens


@pytest.mark.parametrize("options,message", [
    (dict(tree_budget=-2), "tree_budget must be positive"),
    (dict(tree_budget=10**9), "tree_budget must be at most the target's context length"),
])
def test_stream_generate_refuses_a_bad_tree_request(pair, options, message):
    model, tokenizer, draft = pair
    with pytest.raises(DFlashError, match=message):
        next(stream_generate(model, draft, tokenizer, "hello", max_tokens=4, **options))


def dflash(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "dflash_mlx", *map(str, args)], capture_output=True,
                          input=b"", cwd=cwd)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def test_the_command_line_generates_with_a_tree(pair, target_dirs, draft_dir, tmp_path):
    model, tokenizer, draft = pair
    prompt = "the quick brown fox"
    want = [t for t, _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=12)]
    code, out, err = dflash("generate", "-m", target_dirs["qwen3_5"], "-d", draft_dir("qwen3_5", block_size=8),
                            "-p", prompt, "-n", 12, "--no-chat-template", "--tree-budget", 6, cwd=tmp_path)
    assert code == 0, err
    assert out.strip() == tokenizer.decode(want).strip()
    assert "tokens/cycle" in err and "(tree of 6, block 8)" in err


@pytest.mark.parametrize("budget,message", [
    (-1, "error: --tree-budget must be positive (0: no tree), got -1"),
    (4097, "error: --tree-budget must be at most the target's context length 4096, got 4097"),
])
def test_the_command_line_refuses_a_bad_tree_budget(target_dirs, draft_dir, tmp_path, budget, message):
    code, out, err = dflash("generate", "-m", target_dirs["qwen3_5"], "-d", draft_dir("qwen3_5", block_size=8),
                            "-p", "hi", "--tree-budget", budget, cwd=tmp_path)
    assert code == 1 and out == "" and err.strip().splitlines() == [message]
