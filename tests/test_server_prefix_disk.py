"""The prefix cache's disk tier: entries outlive the server (plain and hybrid
targets, quantized K/V), a corrupt, truncated or foreign file is removed with
one warning and never changes a reply, two servers sharing a directory leave
it loadable, the switch off writes nothing, and the directory stays within its
byte budget, least recently used first out."""

import json
import threading

import httpx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from dflash_mlx import Target
from dflash_mlx.server.prefix_cache import PrefixCache
from dflash_mlx.server.prefix_disk import LAYOUT, META, DiskConfig, DiskTier, pair_key
from test_server import KEY, running_server
from test_kv_quantization import pairs  # noqa: F401 (fixture: pairs whose head dimension MLX quantizes)
from test_server_prefix import cold, pair, serve_one, words  # noqa: F401 (fixture: the qwen3 and qwen3_5 pairs)

PROMPT = "the disk tier keeps this prompt across restarts of the server " * 4


def serving(log_dir, target_dirs, draft_dir, family, directory, *options):
    log_dir.mkdir(parents=True, exist_ok=True)
    return running_server(log_dir, target_dirs[family], draft_dir(family, block_size=4), "--api-key", KEY,
                          "--prefix-cache-dir", str(directory), *options)


def complete(url, prompt, max_tokens=12):
    """(text, cached prompt tokens, prompt tokens) of a greedy completion."""
    reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    reply.raise_for_status()
    usage = reply.json()["usage"]
    return reply.json()["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def files(directory):
    return sorted(directory.glob("*/*.safetensors"))


def warnings(log_dir):
    return [line for log in log_dir.glob("*.log") for line in log.read_text().splitlines()
            if line.startswith("warning: prefix cache on disk")]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_prompt_served_before_a_restart_is_all_cached_but_its_last_token(family, target_dirs, draft_dir, tmp_path):
    directory = tmp_path / "cache"
    with serving(tmp_path, target_dirs, draft_dir, family, directory) as (url, _):
        text, cached, _ = complete(url, PROMPT)
    assert cached == 0 and len(files(directory)) == 1  # written before the server stopped
    with serving(tmp_path, target_dirs, draft_dir, family, directory) as (url, _):
        again, cached, prompt_tokens = complete(url, PROMPT)
        disk = httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()["prefix_cache"]["disk"]
    assert (again, cached) == (text, prompt_tokens - 1) and not warnings(tmp_path)
    assert disk["hits"] == 1 and disk["entries"] >= 1 and disk["writable"]


def spoil(paths):
    """Four files spoiled four ways: truncated, garbage, another layout, another pair."""
    truncated, garbage, layout, other = paths
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    garbage.write_bytes(bytes(range(256)) * (garbage.stat().st_size // 256))
    for path, change in [(layout, lambda m: m.update(layout=LAYOUT + 1)),
                         (other, lambda m: m["pair"]["target"].update(id="another/model"))]:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
        meta = json.loads(metadata[META])
        change(meta)
        save_prompt_cache(str(path), caches, {META: json.dumps(meta)})


def test_corrupt_truncated_and_foreign_files_are_removed_with_one_warning_each(target_dirs, draft_dir, tmp_path):
    directory = tmp_path / "cache"
    prompts = [f"{word} {PROMPT}" for word in ("one", "two", "three", "four")]
    with serving(tmp_path / "first", target_dirs, draft_dir, "qwen3_5", directory) as (url, _):
        texts = [complete(url, p)[0] for p in prompts]
    stored = files(directory)
    assert len(stored) == 4
    spoil(stored)
    logs = tmp_path / "second"
    with serving(logs, target_dirs, draft_dir, "qwen3_5", directory) as (url, _):
        served = [complete(url, p)[:2] for p in prompts]
    assert served == [(text, 0) for text in texts]  # from scratch, as the first time
    lines = warnings(logs)
    assert len(lines) == 4 and all(sum(str(path) in line for line in lines) == 1 for path in stored)
    assert any("truncated" in line for line in lines) and any(f"layout {LAYOUT + 1}" in line for line in lines)
    assert any("another pair" in line for line in lines)
    for path in files(directory):  # what the second server wrote instead loads
        load_prompt_cache(str(path))


def test_two_servers_sharing_a_directory_leave_every_file_loadable(target_dirs, draft_dir, tmp_path):
    directory = tmp_path / "cache"
    prompts = [f"{word} {PROMPT}" for word in ("red", "green", "blue")]
    with serving(tmp_path, target_dirs, draft_dir, "qwen3", directory) as (a, _), \
            serving(tmp_path, target_dirs, draft_dir, "qwen3", directory) as (b, _):
        threads = [threading.Thread(target=complete, args=(url, p)) for url in (a, b) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not warnings(tmp_path)
    assert not [p for p in directory.rglob("*") if p.name.startswith(".") and p.name != ".lock"]  # no temporaries
    assert len(files(directory)) >= len(prompts)  # one file per token list, whichever server wrote it
    for path in files(directory):
        load_prompt_cache(str(path))


def test_the_switch_off_writes_nothing(target_dirs, draft_dir, tmp_path):
    directory = tmp_path / "cache"
    with serving(tmp_path, target_dirs, draft_dir, "qwen3", directory, "--no-prefix-cache-disk") as (url, _):
        complete(url, PROMPT)
        _, cached, prompt_tokens = complete(url, PROMPT)
    assert cached == prompt_tokens - 1 and not directory.exists()  # the RAM tier still serves


def tier(pair, directory, budget=10**9, kv=None, warn=None):
    """A prefix cache over a disk tier in ``directory``, as the engine makes it."""
    target, draft, tokenizer = pair
    key = pair_key("tiny/target", "tiny/draft", draft, tokenizer, kv or {})
    disk = DiskTier(DiskConfig(directory, budget), key, **({"warn": warn} if warn else {}))
    return PrefixCache(target, draft, 10**9, kv, disk)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_quantized_kv_caches_outlive_a_restart(pairs, family, tmp_path):
    model, tokenizer, draft = pairs[family]
    kv_pair = (Target(model), draft, tokenizer)
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 16}
    first = tier(kv_pair, tmp_path, kv=kv)
    serve_one(first, kv_pair, tokenizer.encode(PROMPT), max_tokens=10, **kv)
    (entry,) = first.entries.values()
    assert any(hasattr(c, "bits") for c in entry.context.target)  # quantized where it is written
    first.close()
    # a hybrid target's quantized entry is reused only as it is: a prompt that extends all it holds
    prompt = list(entry.context.tokens) + words(tokenizer, " and then")
    again, reused = serve_one(tier(kv_pair, tmp_path, kv=kv), kv_pair, prompt, max_tokens=10, **kv)
    assert reused == len(entry.context.tokens) and again == cold(kv_pair, prompt, max_tokens=10, **kv)


def test_a_file_spoiled_after_it_was_indexed_is_removed_when_it_is_loaded(pair, tmp_path):
    prompt = pair[2].encode(PROMPT)
    first = tier(pair, tmp_path)
    out, _ = serve_one(first, pair, prompt, max_tokens=8)
    first.close()
    told = []
    second = tier(pair, tmp_path, warn=told.append)
    (stored,) = second.disk.entries()
    stored.path.write_bytes(stored.path.read_bytes()[:-100])
    again, reused = serve_one(second, pair, prompt, max_tokens=8)
    assert (again, reused) == (out, 0) and len(told) == 1 and str(stored.path) in told[0]


def test_the_directory_stays_within_its_budget_least_recently_used_first_out(pair, tmp_path):
    tokenizer = pair[2]
    prompts = [tokenizer.encode(f"{word} {PROMPT}") for word in ("cat", "dog", "fox", "owl")]
    probe = tier(pair, tmp_path / "probe")
    serve_one(probe, pair, prompts[0], max_tokens=4)
    probe.close()
    one = files(tmp_path / "probe")[0].stat().st_size
    cache = tier(pair, tmp_path / "cache", budget=int(2.5 * one))
    for p in prompts[:3]:
        serve_one(cache, pair, p, max_tokens=4)
    cache.close()  # each write waits for the one before: the first written is the oldest
    cache = tier(pair, tmp_path / "cache", budget=int(2.5 * one))
    _, reused = serve_one(cache, pair, prompts[1], max_tokens=4)  # used: now the most recent
    assert reused == len(prompts[1]) - 1
    serve_one(cache, pair, prompts[3], max_tokens=4)
    cache.close()
    stored = tier(pair, tmp_path / "cache").disk.entries()
    kept = [i for i, p in enumerate(prompts) for s in stored if s.tokens[: len(p)] == p]
    assert sorted(kept) == [1, 3]
    assert sum(p.stat().st_size for p in files(tmp_path / "cache")) <= 2.5 * one
