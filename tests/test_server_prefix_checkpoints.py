"""Checkpoints where hybrid prompts diverge: a prompt that shares only part
of a stored one resumes from the nearest checkpoint at or before the point
where they part (the start of the chat template's last turn, or an interval
inside a long prompt), in RAM, on disk and on the real server, and its reply
is the one a server without a prefix cache gives."""

import httpx
import pytest

from dflash_mlx import Target, load, load_draft
from dflash_mlx.chat import template_ids
from dflash_mlx.server.prefix_cache import PrefixCache
from dflash_mlx.server.prefix_checkpoints import common_prefix, nbytes
from test_server import KEY
from test_server_prefix import cold, serve_one, words
from test_server_prefix_disk import complete, serving, tier

HEADERS = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "you are an agent with tools to read and write files and run commands in the shell " * 3


@pytest.fixture(scope="module")
def hybrid(target_dirs, draft_dir):
    model, tokenizer = load(str(target_dirs["qwen3_5"]))
    return Target(model), load_draft(str(draft_dir("qwen3_5", block_size=4))), tokenizer


def test_an_interval_checkpoint_serves_a_prompt_diverging_inside_a_long_shared_prefix(hybrid):
    target, draft, tokenizer = hybrid
    cache = PrefixCache(target, draft, budget_bytes=10**9, interval=16)
    shared = tokenizer.encode(SYSTEM)
    first = shared + words(tokenizer, " first write a test")
    serve_one(cache, hybrid, first, max_tokens=8)
    (entry,) = cache.entries.values()
    assert [c.position for c in entry.checkpoints] == [*range(16, len(first) - 1, 16), len(first) - 1]
    # parts from the first prompt after 40 tokens: resumed from the checkpoint at 32
    second = shared[:40] + words(tokenizer, " and then run it")
    out, reused = serve_one(cache, hybrid, second, max_tokens=12)
    assert reused == 32 and out == cold(hybrid, second, max_tokens=12)
    # the copy keeps the checkpoints at or before 32 and adds its own
    latest = list(cache.entries.values())[-1]
    assert [c.position for c in latest.checkpoints] == [16, 32, len(second) - 1]
    assert cache.stats()["hits"] == 1 and cache.stats()["tokens_saved"] == 32


def test_a_mark_at_the_last_turn_serves_another_final_turn(hybrid):
    target, draft, tokenizer = hybrid
    cache = PrefixCache(target, draft, budget_bytes=10**9, interval=0)
    shared = tokenizer.encode(SYSTEM)
    first = shared + words(tokenizer, " list the files")
    context = cache.resume(first).context
    mark, checkpoints = cache.mark(context, first, tokenizer, marks=[len(shared)])
    assert [c.position for c in checkpoints] == [len(shared), len(first) - 1]
    cache.put(context, mark, checkpoints)
    second = shared + words(tokenizer, " delete the logs")
    out, reused = serve_one(cache, hybrid, second, max_tokens=12, temperature=0.7, seed=5)
    assert reused == len(shared) and out == cold(hybrid, second, max_tokens=12, temperature=0.7, seed=5)


def test_checkpoints_outlive_a_restart_in_the_disk_tier(hybrid, tmp_path):
    tokenizer = hybrid[2]
    shared = tokenizer.encode(SYSTEM)
    first = tier(hybrid, tmp_path)
    first.interval = 16
    serve_one(first, hybrid, shared + words(tokenizer, " first write a test"), max_tokens=8)
    first.close()
    again = tier(hybrid, tmp_path)
    (stored,) = again.disk.entries()
    assert stored.checkpoints[:3] == [16, 32, 48]
    second = shared[:40] + words(tokenizer, " and then run it")
    resumed = again.resume(second)
    assert (len(resumed.context.tokens), resumed.tier) == (32, "disk")
    assert again.stats()["disk"]["tokens_saved"] == 32


def test_a_checkpoint_counts_against_the_budget(hybrid):
    target, draft, tokenizer = hybrid
    prompt = tokenizer.encode(SYSTEM)
    sizes = []
    for interval in (0, 16):
        cache = PrefixCache(target, draft, budget_bytes=10**9, interval=interval)
        serve_one(cache, hybrid, prompt, max_tokens=4)
        sizes.append(cache.nbytes)
    (entry,) = cache.entries.values()
    one = nbytes(entry.checkpoints[:1])  # every checkpoint's states are alike
    assert sizes[1] - sizes[0] == one * (len(entry.checkpoints) - 1) > 0


def chat(url, messages, max_tokens=12):
    """(text, usage) of a greedy chat completion."""
    reply = httpx.post(url + "/v1/chat/completions", headers=HEADERS, timeout=120,
                       json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"], reply.json()["usage"]


def agent(task, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello what can I do"}, {"role": "user", "content": task}]


def long_prompt(tail):
    """A completion prompt of about 2,600 tokens whose last ~400 are ``tail``'s."""
    shared = " ".join(f"{w} is the word number {i}" for i, w in enumerate(["cat", "dog", "sun"] * 80))
    return shared + " " + " ".join([tail] * 80)


def test_agents_sharing_a_system_prompt_resume_at_the_last_turn_and_after_a_restart(
        target_dirs, draft_dir, tmp_path):
    tokenizer = load(str(target_dirs["qwen3_5"]))[1]
    tasks = ["list the files", "delete the logs", "run the tests"]
    other = [agent(t, "you answer in one line " * 6) for t in ("fix the bug", "add a test")]  # for /v1/messages
    other_turn = common_prefix(template_ids(tokenizer, other[0][:-1]), template_ids(tokenizer, other[1]))
    history = template_ids(tokenizer, agent("x")[:-1])
    turn = common_prefix(history, template_ids(tokenizer, agent(tasks[1])))
    long = [long_prompt(w) for w in ("red", "blue", "green")]
    parted = common_prefix(*[tokenizer.encode(p) for p in long[:2]])
    assert 2048 < parted < len(tokenizer.encode(long[0])) - 1
    with serving(tmp_path / "none", target_dirs, draft_dir, "qwen3_5", tmp_path / "unused",
                 "--prefix-cache-gb", "0") as (url, _):
        expected = [chat(url, agent(t))[0] for t in tasks] + [complete(url, p)[0] for p in long]
        alone = [chat(url, m)[0] for m in other]
    directory = tmp_path / "cache"
    with serving(tmp_path / "first", target_dirs, draft_dir, "qwen3_5", directory) as (url, _):
        served = [chat(url, agent(t)) for t in tasks[:2]]
        completed = [complete(url, p) for p in long[:2]]
        health = httpx.get(url + "/health", headers=HEADERS).json()["prefix_cache"]
        # the Messages route checkpoints its conversations where their last turn starts too
        messages = [httpx.post(url + "/v1/messages", headers=HEADERS, timeout=120, json={
            "model": "m", "system": system["content"], "messages": turns, "max_tokens": 12, "temperature": 0}).json()
            for system, *turns in other]
    assert [(m["content"][0]["text"], m["usage"]["cache_read_input_tokens"]) for m in messages] == [
        (alone[0], 0), (alone[1], other_turn)]
    assert [text for text, _ in served] == expected[:2]
    details = [usage["prompt_tokens_details"] for _, usage in served]
    assert details == [{"cached_tokens": 0, "cache_tier": None}, {"cached_tokens": turn, "cache_tier": "ram"}]
    # the long prompts part after `parted` tokens: the second resumes at the last interval before that
    assert [(text, cached) for text, cached, _ in completed] == [(expected[3], 0), (expected[4], 2048)]
    assert (health["hits"], health["tokens_saved"]) == (2, turn + 2048)
    with serving(tmp_path / "second", target_dirs, draft_dir, "qwen3_5", directory) as (url, _):
        text, usage = chat(url, agent(tasks[2]))
        again, cached, _ = complete(url, long[2])
        disk = httpx.get(url + "/health", headers=HEADERS).json()["prefix_cache"]["disk"]
    assert (text, usage["prompt_tokens_details"]) == (expected[2], {"cached_tokens": turn, "cache_tier": "disk"})
    assert (again, cached) == (expected[5], 2048)
    assert (disk["hits"], disk["tokens_saved"]) == (2, turn + 2048)
