"""generate --show-drafts: the text of accepted drafts styled apart from the
target's own tokens, checked character by character against the per-cycle
acceptance of a real generation on the bundled demo pair (a trained draft, so
cycles accept 0 to several drafts); plain text, byte for byte the unstyled
output, whenever stdout shows no colors; the stats line in words."""

import os
import pty
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx import DFlashError, load, load_draft, stream_generate
from dflash_mlx.cli import app
from dflash_mlx.demo import demo_pair
from dflash_mlx.display import LEGEND, Tally, styled_console
from dflash_mlx.generate import GenerationResponse

try:
    PAIR = demo_pair()
except DFlashError:  # a checkout before the weights were committed
    PAIR = None

pytestmark = pytest.mark.skipif(PAIR is None, reason="the bundled demo pair is not in this checkout")

N_TOKENS, BLOCK = 32, 8
COLOR = {"FORCE_COLOR": "1", "TERM": "xterm-256color", "NO_COLOR": None, "COLORTERM": None}
GREEN = re.compile(r"\x1b\[32m(.*?)\x1b\[0m", re.DOTALL)


def prompt() -> str:
    return PAIR.load_prompts()[0]


def cli(*args, env=None):
    return CliRunner().invoke(app, ["generate", "-m", str(PAIR.target), "-d", str(PAIR.draft), "-p", prompt(),
                                    "-n", str(N_TOKENS), "-b", str(BLOCK), "--no-chat-template", *args], env=env)


@pytest.fixture(scope="module")
def run():
    """(tokenizer, the responses of the generation the CLI runs below)."""
    model, tokenizer = load(str(PAIR.target))
    responses = list(stream_generate(model, load_draft(str(PAIR.draft)), tokenizer, prompt(),
                                     block_size=BLOCK, max_tokens=N_TOKENS))
    return tokenizer, responses


@pytest.fixture(scope="module")
def plain_text(run):
    return "".join(r.text for r in run[1]) + "\n"


def test_each_response_says_which_of_its_tokens_were_drafted(run):
    _, responses = run
    assert responses[0].drafted == 0  # the prefill's token is the target's
    for r in responses[1:]:  # a cycle commits its accepted drafts, then the target's token
        assert r.drafted == min(r.accepted, len(r.tokens))
    drafted = [r.drafted for r in responses]
    assert max(drafted) >= 2 and drafted.count(0) >= 2  # varied acceptance: the check below bites
    assert sum(len(r.tokens) for r in responses) == responses[-1].generation_tokens == N_TOKENS


def _char_origins(tokenizer, responses, text: str) -> list[bool]:
    """Per character of ``text``: whether its token was an accepted draft,
    from the text each token adds to the decoded prefix (no streaming)."""
    tokens, drafted = [], []
    for r in responses:
        tokens += r.tokens
        drafted += [True] * r.drafted + [False] * (len(r.tokens) - r.drafted)
    origins, decoded = [], ""
    for i, was_drafted in enumerate(drafted):
        now = tokenizer.decode(tokens[: i + 1])
        assert now.startswith(decoded)
        origins += [was_drafted] * (len(now) - len(decoded))
        decoded = now
    shift = len(decoded) - len(text)  # the streaming detokenizer drops the first token's leading space
    assert 0 <= shift <= 1 and decoded[shift:] == text
    return origins[shift:]


def test_styled_text_marks_exactly_the_accepted_drafts(run, plain_text):
    tokenizer, responses = run
    result = cli("--show-drafts", env=COLOR)
    assert result.exit_code == 0, result.stderr
    assert LEGEND in result.stderr.splitlines()
    styled = result.stdout
    assert GREEN.sub(r"\1", styled) == plain_text and "\x1b" not in GREEN.sub("", styled)
    shown_drafted = []
    for i, piece in enumerate(GREEN.split(styled)):  # odd pieces were inside a green span
        shown_drafted += [i % 2 == 1] * len(piece)
    text = plain_text[:-1]
    want = _char_origins(tokenizer, responses, text)
    visible = [i for i, c in enumerate(text) if not c.isspace()]  # a held space may go with the next token
    assert [shown_drafted[i] for i in visible] == [want[i] for i in visible]
    assert any(want[i] for i in visible) and not all(want[i] for i in visible)


@pytest.mark.parametrize("args, env", [
    (["--show-drafts"], None),  # stdout is not a terminal
    (["--show-drafts", "--no-color"], COLOR),
])
def test_plain_text_when_stdout_shows_no_colors(plain_text, args, env):
    result = cli(*args, env=env)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == plain_text
    assert LEGEND not in result.stderr


def test_no_color_in_the_environment_turns_styling_off(monkeypatch):
    for name, value in COLOR.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert styled_console(no_color=False) is not None
    assert styled_console(no_color=True) is None
    monkeypatch.setenv("NO_COLOR", "1")
    assert styled_console(no_color=False) is None
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.delenv("NO_COLOR")
    assert styled_console(no_color=False) is None


def test_on_by_default_for_the_demo_pair_in_a_terminal(tmp_path):
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    try:
        proc = subprocess.run([sys.executable, "-m", "dflash_mlx", "generate", "-p", prompt(), "-n", "24",
                               "-b", str(BLOCK)], stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              env={**env, "TERM": "xterm-256color"}, cwd=tmp_path, timeout=300)
    finally:
        os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: everything was read
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"\x1b[32m" in out and LEGEND in proc.stderr.decode()


def test_the_stats_line_counts_drafted_cycles_and_accepted_drafts(run):
    _, responses = run
    result = cli(env=COLOR)  # --show-drafts is off by default with --model
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "".join(r.text for r in responses) + "\n"
    cycles = len(responses) - 1
    accepted = sum(r.accepted for r in responses[1:])
    drafted = sum(r.block_size - 1 for r in responses[1:])  # b - 1 a cycle; the last ones' b at most the tokens left
    line = result.stderr.strip().splitlines()[-1]
    assert f"generation: {N_TOKENS} tokens" in line
    assert f"| {cycles} cycles, tau {(accepted + cycles) / cycles:.2f} tokens/cycle, every one drafted (block {BLOCK}) |" in line
    assert f"| accepted {accepted} of {drafted} drafted tokens ({accepted / drafted:.1%}) |" in line


def _response(block_size, accepted=0, tokens=1):
    return GenerationResponse(text="", tokens=[0] * tokens, accepted=accepted, prompt_tokens=5, prompt_tps=10.0,
                              generation_tokens=0, generation_tps=20.0, peak_memory=0.5, block_size=block_size)


def _tally(cycles, tree_budget=None):
    tally = Tally()
    for r in [_response(0)] + cycles:
        tally.add(r, tree_budget)
    return tally


def test_the_stats_line_separates_drafting_cycles_from_plain_steps():
    """The case that read as a contradiction ("tau 1.15 ... draft acceptance 85%"):
    few drafting cycles that accept much, many plain steps."""
    cycles = [_response(16, 13)] * 3 + [_response(1)] * 37
    line = _tally(cycles).summary("auto", None, stopped=False)
    assert ("| 40 cycles, tau 1.98 tokens/cycle: 3 drafted (block auto: 16x3) and made 14.00 tokens each, "
            "37 were plain target steps (b = 1, no draft) | accepted 39 of 45 drafted tokens (86.7%) |") in line
    line = _tally([_response(1)] * 6).summary("auto", None, stopped=True)
    assert line.endswith("| 6 cycles, tau 1.00 tokens/cycle, every one a plain target step (b = 1, no draft) "
                         "| peak memory 0.50 GB | stopped at a --stop string")
    line = _tally([_response(8, 3), _response(8, 1)], tree_budget=6).summary(8, 6, stopped=False)
    assert ("| 2 cycles, tau 3.00 tokens/cycle, every one drafted (tree of 6, block 8) "
            "| accepted 4 of 12 drafted tree nodes (33.3%) |") in line
    assert "| no cycles: the prefill's token only |" in _tally([]).summary(16, None, stopped=False)
