"""The server's prefix cache and stop strings, in process: reused caches give
exactly the cold output, on attention-only and hybrid GatedDeltaNet targets."""

import pytest
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import Target, generate, load, load_draft, stream_generate
from dflash_mlx.server.prefix_cache import MAX_ENTRIES, PrefixCache
from dflash_mlx.server.stops import StopMatcher
from test_block_policy import STEEP

# None: the pair's measured curve; STEEP: plain target steps (queued one ahead)
# between probes of speculation
CURVES = [None, STEEP]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request, target_dirs, draft_dir):
    model, tokenizer = load(str(target_dirs[request.param]))
    return Target(model), load_draft(str(draft_dir(request.param, block_size=4))), tokenizer


def serve_one(cache, pair, prompt, stop_after=None, **options):
    """What the engine does for one request: (tokens, reused prompt tokens)."""
    target, draft, tokenizer = pair
    resumed = cache.resume(prompt)
    context, reused = resumed.context, len(resumed.context.tokens)
    mark, checkpoints = cache.mark(context, prompt, tokenizer, kept=resumed.checkpoints)
    tokens = []
    responses = stream_generate(target, draft, tokenizer, prompt, context=context, **options)
    for i, r in enumerate(responses):
        tokens += r.tokens
        if stop_after is not None and i == stop_after:
            break  # the client went away
    responses.close()
    cache.put(context, mark, checkpoints)
    return tokens, reused


def cold(pair, prompt, **options):
    target, draft, tokenizer = pair
    return generate(target, draft, tokenizer, prompt, **options).tokens


def recurrent(target):
    return any(isinstance(c, ArraysCache) for c in target.make_cache())


def words(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("curve", CURVES)
def test_follow_up_prompts_reuse_caches_and_match_the_cold_output(pair, curve):
    target, draft, tokenizer = pair
    cache = PrefixCache(target, draft, budget_bytes=10**9)
    hybrid = recurrent(target)
    p1 = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    out1, reused = serve_one(cache, pair, p1, max_tokens=20, cost_curve=curve)
    assert reused == 0 and out1 == cold(pair, p1, max_tokens=20)
    fed = list(list(cache.entries.values())[0].context.tokens)
    assert fed[: len(p1) + 19] == p1 + out1[:19]  # the prompt and every token fed

    # a chat turn: the old prompt, part of the reply, then new text
    p2 = p1 + out1[:10] + words(tokenizer, " hello world")
    out2, reused = serve_one(cache, pair, p2, max_tokens=20, temperature=0.8, seed=3, cost_curve=curve)
    assert reused == (len(p1) - 1 if hybrid else len(p1) + 10)
    assert out2 == cold(pair, p2, max_tokens=20, temperature=0.8, seed=3, cost_curve=curve)

    # everything the last request fed, extended: reused as it is, even on a hybrid target
    p3 = list(list(cache.entries.values())[-1].context.tokens) + words(tokenizer, " what is")
    out3, reused = serve_one(cache, pair, p3, max_tokens=12, repetition_penalty=1.2, cost_curve=curve)
    assert reused == len(p3) - 2
    assert out3 == cold(pair, p3, max_tokens=12, repetition_penalty=1.2)

    # the same prompt again: all but its last token is reused (on a hybrid
    # target, from the states snapshotted there)
    out4, reused = serve_one(cache, pair, p3, max_tokens=12, repetition_penalty=1.2, cost_curve=curve)
    assert out4 == out3 and reused == len(p3) - 1
    out5, reused = serve_one(cache, pair, p3, max_tokens=12, repetition_penalty=1.2, cost_curve=curve)
    assert out5 == out3 and reused == len(p3) - 1


def test_a_prompt_diverging_inside_a_cached_prompt(pair):
    target, draft, tokenizer = pair
    cache = PrefixCache(target, draft, budget_bytes=10**9)
    p1 = tokenizer.encode("write a short story about a cat who was long")
    serve_one(cache, pair, p1, max_tokens=8)
    p2 = p1[:5] + words(tokenizer, " dog and")
    out, reused = serve_one(cache, pair, p2, max_tokens=16)
    # recurrent states exist only at the old prompt's end but one token: nothing to reuse here
    assert reused == (0 if recurrent(target) else 5)
    assert out == cold(pair, p2, max_tokens=16)
    # the branch got a copy: the first conversation's caches are still whole
    p3 = p1 + words(tokenizer, " and")
    out, reused = serve_one(cache, pair, p3, max_tokens=16)
    assert reused >= len(p1) - 1 and out == cold(pair, p3, max_tokens=16)


@pytest.mark.parametrize("curve", CURVES)
def test_a_request_stopped_mid_generation_leaves_consistent_caches(pair, curve):
    target, draft, tokenizer = pair
    cache = PrefixCache(target, draft, budget_bytes=10**9)
    p1 = tokenizer.encode("hello world what is the capital of france")
    serve_one(cache, pair, p1, stop_after=3, max_tokens=200, cost_curve=curve)
    fed = list(list(cache.entries.values())[0].context.tokens)
    assert len(p1) < len(fed) < len(p1) + 200
    p2 = fed + words(tokenizer, " and")
    out, reused = serve_one(cache, pair, p2, max_tokens=16, cost_curve=curve)
    assert reused == len(fed)
    assert out == cold(pair, p2, max_tokens=16)


def test_the_lru_stays_within_its_budget_and_entry_count(pair):
    target, draft, tokenizer = pair
    prompts = [words(tokenizer, f" {w} is the word") for w in ["cat", "dog", "fox", "sun", "sea",
                                                              "one", "two", "new", "old", "day"]]
    nothing = PrefixCache(target, draft, budget_bytes=0)
    serve_one(nothing, pair, prompts[0], max_tokens=4)
    assert not nothing.entries
    roomy = PrefixCache(target, draft, budget_bytes=10**9)
    for p in prompts:
        serve_one(roomy, pair, p, max_tokens=4)
    assert len(roomy.entries) == MAX_ENTRIES
    one = next(iter(roomy.entries.values())).nbytes
    tight = PrefixCache(target, draft, budget_bytes=2 * one + one // 2)
    for p in prompts[:4]:
        serve_one(tight, pair, p, max_tokens=4)
    kept = [e.context.tokens[: len(p)] for e, p in zip(tight.entries.values(), prompts[2:4])]
    assert kept == prompts[2:4] and tight.nbytes <= tight.budget  # the oldest went first


@pytest.mark.parametrize(
    "segments, stops, emitted, stopped",
    [
        (["hel", "lo wor", "ld"], ["lo w"], "hel", True),
        (["ab", "c", "de"], ["cd", "xyz"], "ab", True),
        (["a<", "/s", "> tail"], ["</s>"], "a", True),
        (["abc", "def"], ["zz"], "abcdef", False),
        (["ab", "c"], ["cx"], "abc", False),  # held back, released at the end
        (["one two three"], ["three", "two"], "one ", True),  # the earliest stop wins
    ],
)
def test_stop_strings_across_segments_are_never_emitted(segments, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out, hit = "", False
    for s in segments:
        text, hit = matcher.feed(s)
        out += text
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == (emitted, stopped)
