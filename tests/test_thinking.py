"""Thinking mode: enable_thinking reaches the chat template only when set, the
registry's per-pair default applies, --thinking / --no-thinking override it on
generate and bench, and stderr names the mode used."""

import json
import shutil

import mlx.core as mx
import pytest
from checkpoints import CHAT_TEMPLATE
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from transformers import AutoTokenizer
from typer.testing import CliRunner

from dflash_mlx.chat import apply_template, encode, template_ids
from dflash_mlx.cli import app
from dflash_mlx.registry import find, resolve_pair

# The tiny tokenizers' template with a thinking switch in front: the marker
# shows which value of enable_thinking the template saw, if any.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% if enable_thinking is defined %}<|system|> "
    "{{ 'think it through step by step' if enable_thinking else 'answer now' }} {% endif %}",
    1,
)


def thinking_target(source, path):
    """A copy of a tiny target whose chat template reacts to enable_thinking."""
    shutil.copytree(source, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir, tmp_path_factory):
    # named like a registry target whose draft was trained without thinking
    target = thinking_target(target_dirs["qwen3"], tmp_path_factory.mktemp("t") / "Qwen3-8B")
    return target, draft_dir("qwen3")


def test_enable_thinking_reaches_the_template_only_when_set(pair):
    target, _ = pair
    tokenizer = AutoTokenizer.from_pretrained(str(target))  # no mlx-lm wrapper: no default of its own
    assert "answer now" not in apply_template(tokenizer, "hi") and "step by step" not in apply_template(tokenizer, "hi")
    assert "answer now" in apply_template(tokenizer, "hi", enable_thinking=False)
    assert "step by step" in apply_template(tokenizer, "hi", enable_thinking=True)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = apply_template(tokenizer, messages, system="be brief", add_generation_prompt=False)
    assert text.index("be brief") < text.index("hi") < text.index("hello") and not text.endswith("<|assistant|>")
    off = template_ids(tokenizer, "hi", enable_thinking=False)
    assert off == encode(tokenizer, apply_template(tokenizer, "hi", enable_thinking=False))
    assert len(off) != len(template_ids(tokenizer, "hi", enable_thinking=True))  # the modes are told apart


def test_templates_without_a_switch_and_tokenizers_without_a_template(target_dirs):
    tokenizer = AutoTokenizer.from_pretrained(str(target_dirs["qwen3"]))  # CHAT_TEMPLATE ignores the switch
    assert apply_template(tokenizer, "hi", enable_thinking=True) == apply_template(tokenizer, "hi")
    tokenizer.chat_template = None
    assert apply_template(tokenizer, "hi", system="be brief", enable_thinking=False) == "be brief\nhi"


def test_registry_defaults_per_pair():
    assert find("mlx-community/Qwen3-8B-4bit").enable_thinking is False  # -b16 drafts: non-thinking chats
    assert find("Qwen/Qwen3.5-9B").enable_thinking is True
    assert find("openai/gpt-oss-20b").enable_thinking is None  # no switch in the template
    assert resolve_pair("/models/Qwen3-4B", "/my/draft").enable_thinking is False
    assert resolve_pair("/models/unknown", "/my/draft").enable_thinking is None


def expected(target, enable_thinking):
    """The target's own greedy output for "hello" through the template, and the prompt length."""
    model, tokenizer = mlx_lm_load(str(target))
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                         add_generation_prompt=True, tokenize=False, **extra)
    ids = encode(tokenizer, text)
    out = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=6)]
    return tokenizer.decode(out).strip(), len(ids)


@pytest.mark.parametrize("flag, enable_thinking, mode", [
    ([], False, "thinking off"),  # the registry's default for Qwen3-8B
    (["--no-thinking"], False, "thinking off"),
    (["--thinking"], True, "thinking on"),
])
def test_generate_passes_the_mode_to_the_template_and_names_it(pair, flag, enable_thinking, mode):
    target, draft = pair
    result = CliRunner().invoke(app, ["generate", "-m", str(target), "-d", str(draft), "-p", "hello",
                                      "-n", "6", *flag])
    assert result.exit_code == 0, result.stderr
    text, prompt_tokens = expected(target, enable_thinking)
    assert result.stdout.strip() == text
    notes = [line for line in result.stderr.splitlines() if line.startswith("chat template:")]
    assert len(notes) == 1 and mode in notes[0]
    assert f"prompt: {prompt_tokens} tokens" in result.stderr


def test_unknown_target_keeps_the_template_default(pair, tmp_path):
    target, draft = pair
    renamed = shutil.copytree(target, tmp_path / "tiny")
    result = CliRunner().invoke(app, ["generate", "-m", str(renamed), "-d", str(draft), "-p", "hello", "-n", "6"])
    assert result.exit_code == 0, result.stderr
    assert "chat template: its default thinking mode" in result.stderr
    assert result.stdout.strip() == expected(renamed, None)[0]
    # no template applied, no line about it
    result = CliRunner().invoke(app, ["generate", "-m", str(renamed), "-d", str(draft), "-p", "hello", "-n", "2",
                                      "--no-chat-template", "--thinking"])
    assert result.exit_code == 0 and "chat template" not in result.stderr


def test_bench_passes_the_mode_and_records_it(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello", "id": "a"}) + "\n")
    for flag, enable_thinking in (([], False), (["--thinking"], True)):
        out = tmp_path / "r.json"
        result = CliRunner().invoke(app, ["bench", "-m", str(target), "-d", str(draft), "--prompts", str(prompts),
                                          "-n", "4", "--no-warmup", "--json", str(out), *flag])
        assert result.exit_code == 0, result.output
        assert f"thinking {'on' if enable_thinking else 'off'}" in result.stderr
        report = json.loads(out.read_text())
        assert report["config"]["enable_thinking"] is enable_thinking
        assert report["prompts"][0]["prompt_tokens"] == expected(target, enable_thinking)[1]
