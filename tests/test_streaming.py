"""Streamed text is complete: the text segments of ``stream_generate``, joined,
are the emitted tokens decoded at once, also when generation stops (at
max_tokens or at EOS) inside a multi-byte UTF-8 character, which the
detokenizer holds back until it is finalized. The target's tokenizer is a
byte-level BPE trained over text with accents, CJK and emoji, so its ids can
end inside a character."""

import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer

from checkpoints import write_draft, write_target
from dflash_mlx import load_draft, stream_generate

PROMPTS = ["café au lait", "中文 and emoji 🙂", "the quick brown fox"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, model, tokenizer, draft) of a tiny qwen3 with the UTF-8 tokenizer."""
    root = tmp_path_factory.mktemp("utf8-pair")
    config = write_target(root / "target", "qwen3", utf8=True)
    write_draft(root / "draft", config, block_size=4)
    model, tokenizer = mlx_lm_load(str(root / "target"))
    return root / "target", model, tokenizer, load_draft(str(root / "draft"))


def streamed(pair, prompt, tokenizer=None, **kwargs):
    """(joined text, emitted tokens, finish reason) of one greedy stream."""
    _, model, own_tokenizer, draft = pair
    responses = list(stream_generate(model, draft, tokenizer or own_tokenizer, prompt, **kwargs))
    tokens = [t for r in responses for t in r.tokens]
    return "".join(r.text for r in responses), tokens, responses[-1].finish_reason


def decoded(tokenizer, tokens):
    """The tokens decoded at once, less the one space a reply may start with:
    mlx-lm's byte-level detokenizer drops it (mlx-lm's own stream_generate
    streams the same)."""
    text = tokenizer.decode(tokens)
    return text[1:] if text.startswith(" ") else text


def _byte_of_symbol() -> dict:
    """GPT-2's byte-level symbols (the characters tokenizer.json spells bytes with) -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def ends_inside_a_character(tokenizer, tokens) -> bool:
    """The tokens' bytes end with a UTF-8 lead byte followed by fewer
    continuation bytes than it announces."""
    table = _byte_of_symbol()
    data = bytes(table[c] for piece in tokenizer.convert_ids_to_tokens(tokens) for c in piece)
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte
            length = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return back < length
    return False


def cut_points(tokenizer, tokens) -> list[int]:
    """Lengths k at which ``tokens[:k]`` ends inside a character."""
    return [k for k in range(1, len(tokens) + 1) if ends_inside_a_character(tokenizer, tokens[:k])]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_is_the_decoded_tokens(pair, prompt):
    tokenizer = pair[2]
    text, tokens, finish = streamed(pair, prompt, max_tokens=MAX_TOKENS)
    assert finish == "length" and len(tokens) == MAX_TOKENS
    assert text == decoded(tokenizer, tokens)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_max_tokens_inside_a_character_streams_the_held_back_bytes(pair, prompt):
    tokenizer = pair[2]
    _, full, _ = streamed(pair, prompt, max_tokens=MAX_TOKENS)
    cuts = cut_points(tokenizer, full)
    assert cuts, "the fixture must cut a character somewhere for this to bite"
    for k in cuts[:3]:
        text, tokens, finish = streamed(pair, prompt, max_tokens=k)
        assert tokens == full[:k] and finish == "length"
        assert text == decoded(tokenizer, tokens) and text.endswith("\ufffd")


def test_eos_inside_a_character_streams_the_held_back_bytes(pair):
    """EOS right after a character's first bytes: an extra EOS id, as a config
    listing several (``eos_token_id: [...]``) gives mlx-lm's tokenizer."""
    path, _, tokenizer, _ = pair
    prompt = PROMPTS[0]
    _, full, _ = streamed(pair, prompt, max_tokens=MAX_TOKENS)
    k = next(k for k in cut_points(tokenizer, full[:-1]) if full[k] not in full[:k])
    stops_there = load_tokenizer(path, eos_token_ids=[tokenizer.eos_token_id, full[k]])
    text, tokens, finish = streamed(pair, prompt, stops_there, max_tokens=MAX_TOKENS)
    assert tokens == full[:k] and finish == "stop"
    assert text == decoded(tokenizer, tokens) and text.endswith("\ufffd")
