"""Structured output stays lossless under speculation: greedy DFlash under a
grammar equals mlx-lm's own decoding with a logits processor applying the same
grammar's mask (the constrained target alone), at every acceptance length;
drafts the grammar rejects are rejected even where the target's raw argmax
agrees with them; at T > 0 the samples follow the constrained target's
distribution; the output parses and matches its schema."""

import json

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.chat import template_ids
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams, warp
from dflash_mlx.structured import Constraint, constraint_for, grammar
from test_loop import one_hot_logits
from test_tree_loop import run
from test_sampling import PROMPT as TINY_PROMPT
from test_sampling import NoisyTargetProposer, chi2_pvalue, model, sample  # model: the spread 16-token target

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    "json_object": {"type": "json_object"},
    "regex": {"type": "regex", "regex": r"(the|a) (cat|dog|fox)( and (the|a) (cat|dog|fox))*\."},
}
PROMPT = "write what is the capital of france"


@pytest.fixture(scope="module")
def llama(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["llama"]))
    return model, tokenizer, load_draft(str(draft_dir("llama", block_size=16)))


class GrammarMask:
    """An mlx-lm logits processor: -inf outside what the grammar allows next,
    from its own llguidance matcher fed the generated tokens; with ``after``
    (ids), free until they have been generated."""

    def __init__(self, tokenizer, response_format, prompt_len, vocab_size, after=()):
        lltok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab_size,
                                             eos_token=list(tokenizer.eos_token_ids))
        self.matcher = LLMatcher(lltok, grammar(response_format))
        self.prompt_len, self.fed, self.vocab_size = prompt_len, 0, vocab_size
        self.after, self.start = list(after), None if after else 0
        self.masks = []  # the mask of every step, for the steered proposer

    def __call__(self, tokens, logits):
        generated = tokens[self.prompt_len :].tolist()
        if self.start is None:
            n = len(self.after)
            self.start = next((i + n for i in range(len(generated)) if generated[i : i + n] == self.after), None)
            if self.start is None:
                self.masks.append(np.ones(self.vocab_size, dtype=bool))
                return logits
        new = generated[self.start + self.fed :]
        self.matcher.try_consume_tokens(new)  # all but an EOS after the grammar stopped
        self.fed += len(new)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        self.masks.append(mask)
        return mx.where(mx.array(mask), logits, -mx.inf)


def constrained_reference(model, tokenizer, prompt_ids, response_format, n, after=()):
    """(tokens up to EOS or n, the grammar's mask at each) of mlx-lm's greedy decoding."""
    mask = GrammarMask(tokenizer, response_format, len(prompt_ids), model.args.vocab_size, after)
    tokens = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n, logits_processors=[mask]):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    return tokens, mask.masks


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_output_is_the_constrained_targets_output(llama, kind, block_size):
    model, tokenizer, draft = llama
    ids = tokenizer.encode(PROMPT)
    want, _ = constrained_reference(model, tokenizer, ids, FORMATS[kind], 48)
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=48, block_size=block_size,
                   response_format=FORMATS[kind])
    assert res.tokens == want
    if res.finish_reason == "stop" and kind != "regex":
        json.loads(res.text)


class SteeredProposer:
    """Proposes the constrained reference continuation, except that the draft
    at index ``corrupt[cycle % len(corrupt)]`` of each block is another token
    the grammar allows there, so every acceptance length occurs."""

    def __init__(self, prompt_len, continuation, masks, corrupt, vocab_size):
        self.position, self.prompt_len, self.cycles = 0, prompt_len, 0
        self.continuation, self.corrupt, self.vocab_size = continuation, corrupt, vocab_size
        self.others = [int(np.flatnonzero(m & (np.arange(vocab_size) != t))[0]) if (m.sum() > 1) else None
                       for m, t in zip(masks, continuation)]

    def observe(self, features, tokens):
        self.position += tokens.size

    def propose(self, y, block_size):
        start = self.position - self.prompt_len + 1  # index of d_1 in the continuation
        tokens = list(self.continuation[start : start + block_size - 1])
        tokens += [0] * (block_size - 1 - len(tokens))
        at = self.corrupt[self.cycles % len(self.corrupt)]
        self.cycles += 1
        if at is not None and start + at < len(self.others) and self.others[start + at] is not None:
            tokens[at] = self.others[start + at]
        return one_hot_logits(tokens, self.vocab_size)


def steered(model, tokenizer, ids, response_format, want, masks, n):
    """(at least n tokens, accepted per cycle) of b = 5 cycles under the format,
    drafted by a ``SteeredProposer`` whose first wrong draft is at 0..3, or none."""
    target = Target(model)
    proposer = SteeredProposer(len(ids), want, masks, [0, 1, 2, 3, None], target.vocab_size)
    sampler = BlockSampler(SamplingParams(), constraint_for(response_format, tokenizer, target.vocab_size))
    return run(SpeculativeDecoder(target, proposer, [0], 5, sampler=sampler), ids, n)


def test_every_acceptance_length_under_a_grammar(llama):
    """b = 5: blocks whose first wrong draft is at each index 0..3, and none."""
    model, tokenizer, _ = llama
    ids = tokenizer.encode(PROMPT)
    response_format = FORMATS["json_schema"]
    want, masks = constrained_reference(model, tokenizer, ids, response_format, 60)
    out, accepted = steered(model, tokenizer, ids, response_format, want, masks, 40)
    assert out[: len(want)] == want[: len(out)]
    assert set(accepted) == {0, 1, 2, 3, 4}


def test_the_grammar_starts_after_its_opening_text(llama):
    """``after``: free until two tokens of the target's own continuation are
    generated, then the grammar; through the API and at every acceptance length."""
    model, tokenizer, draft = llama
    ids = tokenizer.encode(PROMPT)
    raw = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=8)]
    opening = tokenizer.decode(raw[3:5])
    assert tokenizer.encode(opening, add_special_tokens=False) == raw[3:5]
    response_format = FORMATS["json_schema"] | {"after": opening}
    want, masks = constrained_reference(model, tokenizer, ids, FORMATS["json_schema"], 60, after=raw[3:5])
    assert want[:5] == raw[:5] and want[5:7] != raw[5:7]  # free, then held to the grammar
    for block_size in (2, 8):
        res = generate(model, draft, tokenizer, PROMPT, max_tokens=60, block_size=block_size,
                       response_format=response_format)
        assert res.tokens == want
    out, accepted = steered(model, tokenizer, ids, response_format, want, masks, len(want))
    assert out[: len(want)] == want and set(accepted) == {0, 1, 2, 3, 4}


def test_a_reduced_drafting_vocabulary_under_a_grammar(llama, monkeypatch):
    """Drafts over 24 ids the grammar mostly rules out: a draft row with no
    allowed id left is drawn uniformly from the allowed ones (never from -inf
    everywhere), and the output is still the constrained target's."""
    from dflash_mlx.draft import rank_tokens

    model, tokenizer, draft = llama
    ids = tokenizer.encode(PROMPT)
    monkeypatch.setattr(draft, "vocab_ranking", rank_tokens(ids, model.args.vocab_size), raising=False)
    want, _ = constrained_reference(model, tokenizer, ids, FORMATS["json_schema"], 40)
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=40, block_size=4, draft_vocab=24,
                   response_format=FORMATS["json_schema"])
    assert res.tokens == want
    constraint = constraint_for(FORMATS["json_schema"], tokenizer, model.args.vocab_size)
    first = np.array(constraint.allowed([]))  # only "{" (and whitespace) may open the object
    row = mx.where(mx.array(first), -mx.inf, mx.zeros((1, model.args.vocab_size)))
    drawn = np.array(constraint.restrict_next(row, []))[0]
    assert (drawn[first] == 0).all() and np.isneginf(drawn[~first]).all()
    sampler = BlockSampler(SamplingParams(temperature=1.0, seed=0), constraint)
    tokens, q = sampler.draft(mx.concatenate([row, row]))
    assert first[tokens[0].item()] and np.isfinite(np.array(q)[0][first]).all()


def test_plain_steps_between_blocks_under_a_grammar(llama):
    """b = 1 (a plain target step, masked after the token it feeds) mixed with
    drafted blocks of the real draft."""
    from test_block_policy import ScriptedPolicy

    from dflash_mlx.loop.decoder import proposer_for

    model, tokenizer, draft = llama
    ids = tokenizer.encode(PROMPT)
    response_format = FORMATS["json_schema"]
    want, _ = constrained_reference(model, tokenizer, ids, response_format, 60)
    target = Target(model)
    blocks = [1, 1, 4, 1, 2, 8, 1, 1, 3, 1, 1, 1]
    sampler = BlockSampler(SamplingParams(), constraint_for(response_format, tokenizer, target.vocab_size))
    decoder = SpeculativeDecoder(target, proposer_for(draft, target), draft.config.target_layer_ids,
                                 ScriptedPolicy(blocks + [1]), sampler=sampler)
    out = [decoder.prefill(mx.array(ids))]
    for _ in blocks:
        out += decoder.cycle().tokens
    assert out == want[: len(out)]


class RawDrafts:
    """Drafts chosen by the proposer itself (as DFlash2's walk does), never
    masked: the target's unconstrained greedy continuation."""

    def __init__(self, prompt_len, continuation):
        self.position, self.prompt_len, self.continuation = 0, prompt_len, continuation

    def observe(self, features, tokens):
        self.position += tokens.size

    def draft_block(self, y, block_size, sampler):
        start = self.position - self.prompt_len + 1
        tokens = list(self.continuation[start : start + block_size - 1])
        return mx.array(tokens + [0] * (block_size - 1 - len(tokens)), dtype=mx.int32), None


def test_drafts_the_grammar_rejects_are_rejected(llama):
    """The target's raw argmax continuation leaves the grammar at once; as
    drafts it must be rejected there, though the unmasked target agrees."""
    model, tokenizer, _ = llama
    ids = tokenizer.encode(PROMPT)
    raw = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]
    response_format = FORMATS["regex"]
    want, _ = constrained_reference(model, tokenizer, ids, response_format, 40)
    target = Target(model)
    sampler = BlockSampler(SamplingParams(), constraint_for(response_format, tokenizer, target.vocab_size))
    decoder = SpeculativeDecoder(target, RawDrafts(len(ids), raw), [0], 8, sampler=sampler)
    out = [decoder.prefill(mx.array(ids))]
    while len(out) < len(want):
        out += decoder.cycle().tokens
    assert raw[: len(want)] != want  # the unconstrained target leaves the grammar
    assert out[: len(want)] == want


def test_output_matches_the_schema(llama):
    model, tokenizer, draft = llama
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=200, block_size=4,
                   response_format=FORMATS["json_schema"], temperature=0.8, seed=1)
    assert res.finish_reason == "stop"
    value = json.loads(res.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    unwrapped = generate(model, draft, tokenizer._tokenizer, PROMPT, max_tokens=200, block_size=4,
                         response_format=FORMATS["json_schema"], temperature=0.8, seed=1)
    assert unwrapped.tokens == res.tokens  # a Hugging Face tokenizer as it is


@pytest.mark.parametrize("response_format, named", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": "person"}, "json_schema.schema"),
    ({"type": "json_object", "after": 3}, "after must be text"),
    ({"type": "regex", "regex": "[0-9"}, "regex"),
    ({"type": "xml"}, "'xml'"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}},
     "the grammar cannot produce any value"),
    ("json", "must be an object"),
])
def test_a_bad_format_is_one_error_line_naming_it(llama, response_format, named):
    model, tokenizer, draft = llama
    with pytest.raises(DFlashError) as e:
        generate(model, draft, tokenizer, PROMPT, max_tokens=4, response_format=response_format)
    message = str(e.value)
    assert message.startswith("response_format: ") and named in message and "\n" not in message


def test_a_tree_under_a_grammar_is_the_constrained_targets_output(llama):
    """DDTree: each node's row masked after its own path; through the API,
    and with oracle trees whose walk accepts 3 and 2 drafts a cycle."""
    from test_tree_loop import oracle_cycles

    model, tokenizer, draft = llama
    ids = tokenizer.encode(PROMPT)
    response_format = FORMATS["json_schema"]
    want, _ = constrained_reference(model, tokenizer, ids, response_format, 40)
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=40, block_size=4, tree_budget=8,
                   response_format=response_format)
    assert res.tokens == want
    for stop, second in [(3, {1}), (2, set())]:
        sampler = BlockSampler(SamplingParams(), constraint_for(response_format, tokenizer, model.args.vocab_size))
        for _ in oracle_cycles(Target(model), ids, want, stop, second, block=5, budget=16, cycles=4, sampler=sampler):
            pass


# ---------------------------------------------------------------- T > 0
V = 16
LETTERS = "abcdefghijklmno"  # ids 0..14; id 15 is EOS
TINY_GRAMMAR = LLMatcher.grammar_from_regex("((a|b)[c-f]|[g-k]){6,}")  # no end within 4 tokens
RUNS = 400
ALPHA = 1e-3 / 3


class LetterTokenizer:
    """One letter per id, for llguidance's TokenizerWrapper."""

    eos_token_id, bos_token_id = 15, None
    tokens = [c.encode() for c in LETTERS] + [b"</s>"]
    special_token_ids = [15]

    def __call__(self, text):
        return [LETTERS.index(c) for c in text.decode()]


LETTER_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(LetterTokenizer()))


def letter_constraint():
    return Constraint(LLMatcher(LETTER_TOKENIZER, TINY_GRAMMAR, log_level=0), V, LETTER_TOKENIZER.eos_tokens)


def allowed(prefix):
    """The grammar's mask after ``prefix``, from a fresh matcher."""
    matcher = LLMatcher(LETTER_TOKENIZER, TINY_GRAMMAR, log_level=0)
    assert matcher.consume_tokens(prefix)
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:V].astype(bool)


def constrained_joint(model, params, prompt, depth):
    """P(x1..x_depth) of the target alone under the grammar's mask, enumerated
    over the prefixes the grammar allows."""
    joint = np.zeros([V] * depth)
    prefixes, probs = [[]], np.ones(1)
    for _ in range(depth):
        logits = model(mx.array([prompt + p for p in prefixes]))[:, -1]
        masks = mx.array(np.stack([allowed(p) for p in prefixes]))
        cond = np.exp(np.array(warp(mx.where(masks, logits, -mx.inf), params), dtype=np.float64))
        probs = (probs[:, None] * cond).reshape(-1)
        prefixes = [p + [v] for p in prefixes for v in range(V)]
        prefixes, probs = [p for p, w in zip(prefixes, probs) if w > 0], probs[probs > 0]
    for p, w in zip(prefixes, probs):
        joint[tuple(p)] = w
    return joint


@pytest.mark.statistical
def test_samples_follow_the_constrained_targets_distribution(model):
    params = SamplingParams(temperature=1.0)
    tokens, accepted = sample(model, params, make_sampler=lambda p: BlockSampler(p, letter_constraint()),
                              proposer=NoisyTargetProposer, runs=RUNS)
    assert accepted.max() >= 2  # drafts were accepted, not only the target's own tokens
    joint = constrained_joint(model, params, TINY_PROMPT, tokens.shape[1])
    marginal = lambda *keep: joint.sum(axis=tuple(j for j in range(joint.ndim) if j not in keep))
    for cols in ([0, 1], [1, 2], [3]):
        assert chi2_pvalue(tokens[:, cols], marginal(*cols)) > ALPHA, cols


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(target_dirs, draft_dir, tmp_path_factory):
    from test_server import running_server

    with running_server(tmp_path_factory.mktemp("server"), target_dirs["llama"],
                        draft_dir("llama", block_size=16), "--block-size", "4") as (url, _):
        yield url


def test_the_server_answers_in_the_schema_streamed_and_not(server, llama):
    import openai

    model, tokenizer, draft = llama
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "who are you"}]
    options = dict(max_tokens=120, temperature=0.8, seed=3, response_format=FORMATS["json_schema"])
    want = generate(model, draft, tokenizer, template_ids(tokenizer, messages), block_size=4, **options)
    reply = client.chat.completions.create(model="any", messages=messages, **options)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == "stop" and set(json.loads(want.text)) == {"name", "age"}
    streamed = client.chat.completions.create(model="any", messages=messages, stream=True, **options)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text

    regex = FORMATS["regex"]  # the completions route takes it too (not in the client's signature)
    text = client.completions.create(model="any", prompt=PROMPT, max_tokens=40,
                                     extra_body={"response_format": regex}).choices[0].text
    assert text == generate(model, draft, tokenizer, PROMPT, block_size=4, max_tokens=40, response_format=regex).text


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_a_bad_schema_is_a_400_naming_it(server, route, body):
    import httpx

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    r = httpx.post(server + route, json=body | {"response_format": bad, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "objectx" in error["message"]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from scripted import write_scripted_target
    from test_server import running_server

    from checkpoints import write_draft

    target, draft = tmp_path_factory.mktemp("scripted-target"), tmp_path_factory.mktemp("scripted-draft")
    write_draft(draft, write_scripted_target(target), block_size=4)
    with running_server(tmp_path_factory.mktemp("server"), target, draft, "--block-size", "4") as (url, _):
        yield url


def test_a_thinking_reply_reasons_freely_and_answers_in_the_grammar(thinking_server):
    """The template leaves <think> open: the reasoning is the model's own, the
    grammar holds the answer after </think> (held from the first token, the
    scripted reply would have no reasoning and no room for its answer)."""
    import openai

    from scripted import ANSWER, REASONING

    client = openai.OpenAI(base_url=thinking_server + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "weather?"}], max_tokens=32,
        response_format={"type": "regex", "regex": "( hello| world)+"})
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING.lstrip()
    assert message.content == ANSWER and reply.choices[0].finish_reason == "stop"


def test_logprobs_under_a_grammar_list_only_possible_tokens(server):
    """Tokens the grammar rules out have no log-probability (-inf is no JSON):
    forced positions list fewer alternatives than asked for."""
    import math

    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=stream,
            logprobs=True, top_logprobs=20, response_format=FORMATS["regex"])
        chunks = list(reply) if stream else [reply]
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert entries and all(math.isfinite(e.logprob) for e in entries)
        assert all(1 <= len(e.top_logprobs) <= 20 and all(math.isfinite(t.logprob) for t in e.top_logprobs)
                   for e in entries)
        assert any(len(e.top_logprobs) < 20 for e in entries)
