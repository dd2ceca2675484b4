"""A quantized KV cache (kv_bits): token-identical to mlx-lm's generate_step
run with the same kv_bits, kv_group_size and quantized_kv_start, whatever
the drafts' acceptance, with exact rollback; the server's prefix cache and
engine with it."""

import mlx.core as mx
import pytest
from checkpoints import write_draft, write_target
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache
from test_loop import OracleProposer
from test_tree_loop import run
from typer.testing import CliRunner

from dflash_mlx import Target, generate, load_draft, stream_generate
from dflash_mlx.cli import app
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.errors import DFlashError
from dflash_mlx.kv_quantization import KVQuantization
from dflash_mlx.server.engine import Engine
from dflash_mlx.server.prefix_cache import PrefixCache
from dflash_mlx.tree import TreeDecoder

HEAD_DIM = 32  # the tiny targets' 16 is below MLX's smallest quantization group
PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 250, 3, 77]  # 11 tokens
TOKENS = 24


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (mlx-lm model, tokenizer, draft) with head_dim 32."""
    out = {}
    for family in ("llama", "qwen3_5"):
        target_dir = tmp_path_factory.mktemp(f"kv-target-{family}")
        config = write_target(target_dir, family, head_dim=HEAD_DIM)
        draft_dir = tmp_path_factory.mktemp(f"kv-draft-{family}")
        write_draft(draft_dir, config, block_size=8)
        model, tokenizer = mlx_lm_load(str(target_dir))
        out[family] = (model, tokenizer, load_draft(str(draft_dir)))
    return out


def mlx_lm_tokens(model, n, kv: KVQuantization, step: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n, prefill_step_size=step,
                                        kv_bits=kv.bits, kv_group_size=kv.group_size,
                                        quantized_kv_start=kv.start)]


class Oracle(OracleProposer):
    """The continuation, corrupted at ``corrupt_at`` when the block reaches it."""

    def propose(self, y, block_size):
        saved = self.corrupt_at
        if saved is not None and saved >= block_size - 1:
            self.corrupt_at = None
        try:
            return super().propose(y, block_size)
        finally:
            self.corrupt_at = saved


# start 0: from the second pass on; 10: inside the prompt (its last prefill
# chunk, 8..11, would straddle it); 16: inside the decode (a block would straddle it)
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("start", [0, 10, 16])
def test_every_acceptance_length_is_mlx_lm_with_the_same_kv_quantization(pairs, family, start):
    model, _, _ = pairs[family]
    kv = KVQuantization(bits=4, group_size=32, start=start)
    want = mlx_lm_tokens(model, TOKENS + 8, kv, step=4)
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=TOKENS)]
    assert want[:TOKENS] != plain, "the quantization changes nothing here: the test proves nothing"
    target = Target(model)
    for block_size, corrupt_at in [(2, None), (2, 0), (6, None), (6, 0), (6, 2)]:
        oracle = Oracle(len(PROMPT), want, corrupt_at, target.vocab_size)
        decoder = SpeculativeDecoder(target, oracle, [0], block_size, prefill_step_size=4, kv=kv)
        out, accepted = run(decoder, PROMPT, TOKENS)
        assert out[:TOKENS] == want[:TOKENS], (block_size, corrupt_at)
        if corrupt_at != 0:
            assert max(accepted) > 0
        kinds = [type(c) for c in decoder.cache]
        assert QuantizedKVCache in kinds
        assert all(k in (QuantizedKVCache, ArraysCache) for k in kinds)
        offsets = [c.offset for c in decoder.cache if isinstance(c, QuantizedKVCache)]
        assert offsets == [len(decoder.tokens)] * len(offsets)  # rolled back exactly


def test_generate_with_kv_bits_is_mlx_lm_with_kv_bits(pairs):
    model, tokenizer, draft = pairs["llama"]
    kv = KVQuantization(bits=8, group_size=32, start=12)
    want = mlx_lm_tokens(model, TOKENS, kv, step=2048)
    for block_size in (3, 8):
        res = generate(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, block_size=block_size,
                       kv_bits=8, kv_group_size=32, quantized_kv_start=12)
        assert res.tokens == want[: len(res.tokens)] and len(res.tokens) == TOKENS


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_ddtree_with_a_quantized_kv_cache_is_mlx_lm_with_it(pairs, family):
    """The tree is cut to end at quantized_kv_start as the chain's block is
    (down to the root alone), on oracle drafts the walk follows to full depth
    or leaves at once, and through the API with the real draft."""
    model, tokenizer, draft = pairs[family]
    kv = KVQuantization(bits=4, group_size=32, start=16)
    want = mlx_lm_tokens(model, TOKENS + 8, kv, step=4)
    target = Target(model)
    for block_size, budget, corrupt_at in [(4, 6, None), (6, 10, None), (6, 10, 0)]:
        oracle = Oracle(len(PROMPT), want, corrupt_at, target.vocab_size)
        decoder = TreeDecoder(target, oracle, [0], block_size, budget, prefill_step_size=4, kv=kv)
        out, blocks = [decoder.prefill(mx.array(PROMPT))], []
        while len(out) < TOKENS:
            blocks.append(decoder.block_size)
            out += decoder.cycle().tokens
        assert out[:TOKENS] == want[:TOKENS], (block_size, budget, corrupt_at)
        assert 1 in blocks or 16 - len(PROMPT) in blocks  # cut at the start
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, block_size=4, tree_budget=5,
                   kv_bits=4, kv_group_size=32, quantized_kv_start=16, prefill_step_size=4)
    assert res.tokens == want[:TOKENS]


def test_bad_kv_options_are_one_line_errors(pairs):
    model, tokenizer, draft = pairs["llama"]
    for options, words in [(dict(kv_bits=7), "kv_bits must be one of"),
                           (dict(kv_bits=4, kv_group_size=48), "kv_group_size must be one of"),
                           (dict(kv_bits=4, kv_group_size=64), "does not divide the target's head dimension 32; "
                                                                "use 32$"),
                           (dict(kv_bits=4, quantized_kv_start=-1), "quantized_kv_start must be")]:
        with pytest.raises(DFlashError, match=words):
            generate(model, draft, tokenizer, PROMPT, max_tokens=2, **options)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_a_head_dimension_no_group_size_divides_is_refused_without_advice_in_circles(target_dirs, draft_dir,
                                                                                      group_size):
    """Head dimension 16 (the tiny llama's): no group size MLX quantizes (32,
    64, 128) divides it, so no group size is suggested: kv_bits cannot serve it."""
    model, tokenizer = mlx_lm_load(str(target_dirs["llama"]))
    draft = load_draft(str(draft_dir("llama")))
    with pytest.raises(DFlashError) as error:
        generate(model, draft, tokenizer, PROMPT, max_tokens=2, kv_bits=4, kv_group_size=group_size)
    message = str(error.value)
    assert "cannot serve this target" in message and "head dimension 16" in message
    assert message.endswith("run without kv_bits (--kv-bits)") and "use " not in message
    assert "\n" not in message


def test_the_cli_refuses_such_a_target_in_one_line(target_dirs, draft_dir):
    res = CliRunner().invoke(app, ["generate", "--model", str(target_dirs["llama"]), "--draft",
                                   str(draft_dir("llama")), "-p", "x", "--kv-bits", "4", "--kv-group-size", "32"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith("error: kv_bits cannot serve this target") and "head dimension 16" in lines[0]


def test_layers_that_share_kv_are_refused_before_any_group_size_advice(target_dirs, draft_dir):
    """Gemma 4 (head dimension 16, layers sharing K/V): the sharing is what
    rules kv_bits out, whatever the group size."""
    model, tokenizer = mlx_lm_load(str(target_dirs["gemma4"]))
    draft = load_draft(str(draft_dir("gemma4")))
    for group_size in (32, 64):
        with pytest.raises(DFlashError, match="layers share K/V") as error:
            generate(model, draft, tokenizer, PROMPT, max_tokens=2, kv_bits=4, kv_group_size=group_size)
        assert "group size" not in str(error.value) and "head dimension" not in str(error.value)


def test_a_verified_block_ends_at_the_quantization_start():
    kv = KVQuantization(4, 32, start=10)
    assert [kv.block(p, 4) for p in (5, 6, 7, 10)] == [4, 4, 3, 4]


def serve_one(cache, pair, prompt, **options):
    """What the server's engine does for one request: (tokens, prompt tokens reused)."""
    model, tokenizer, draft = pair
    context = cache.resume(prompt).context
    reused = len(context.tokens)
    mark, snapshot = cache.mark(context, prompt, tokenizer)
    tokens = [t for r in stream_generate(model, draft, tokenizer, prompt, context=context, **options)
              for t in r.tokens]
    cache.put(context, mark, snapshot)
    return tokens, reused


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_prefix_cache_reuses_quantized_caches_exactly(pairs, family):
    model, tokenizer, draft = pairs[family]
    target = Target(model)
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=20)
    options = dict(max_tokens=TOKENS, block_size=4, **kv)
    cold = lambda prompt: generate(model, draft, tokenizer, prompt, **options).tokens  # noqa: E731
    cache = PrefixCache(target, draft, budget_bytes=10**9, kv=kv)
    long = PROMPT * 3  # 33 tokens: quantized from the prefill's last token on
    first, reused = serve_one(cache, pairs[family], long, **options)
    assert reused == 0 and first == cold(long)
    # the same prompt again: the quantized cache trimmed back to all but its last token
    # (a recurrent target is not snapshotted with kv_bits, so it starts afresh)
    again, reused = serve_one(cache, pairs[family], long, **options)
    assert again == first and reused == (0 if family == "qwen3_5" else len(long) - 1)
    # branching below the start: a quantized cache is never rolled back there
    branch = PROMPT[:10] + [400, 401, 402]
    out, reused = serve_one(cache, pairs[family], branch, **options)
    assert reused == 0 and out == cold(branch)
    # a follow-up whose new tokens cross the start: converted where a cold run converts
    cache = PrefixCache(target, draft, budget_bytes=10**9, kv=dict(kv, quantized_kv_start=40))
    first, _ = serve_one(cache, pairs[family], PROMPT, **dict(options, quantized_kv_start=40))
    follow = PROMPT + first + [9, 10, 11, 12, 13, 14, 15]
    out, reused = serve_one(cache, pairs[family], follow, **dict(options, quantized_kv_start=40))
    assert reused > len(PROMPT) and out == generate(model, draft, tokenizer, follow,
                                                    **dict(options, quantized_kv_start=40)).tokens


def test_the_server_engine_runs_every_request_with_its_kv_options(pairs, tmp_path):
    model, tokenizer, draft = pairs["llama"]
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=12)
    engine = Engine("unused", "unused", block_size=4, kv=kv)
    engine.target, engine.draft, engine.tokenizer = Target(model), draft, tokenizer
    got = [t for r in engine._stream(PROMPT, max_tokens=TOKENS) for t in r.tokens]
    assert got == mlx_lm_tokens(model, TOKENS, KVQuantization(8, 32, 12), step=2048)
    assert isinstance(engine._prefix_cache(), PrefixCache) and engine._prefix_cache().kv == kv
    runner = CliRunner()
    for args, words in [(["--kv-bits", "7"], "--kv-bits must be one of"),
                        (["--kv-bits", "4", "--kv-group-size", "20"], "--kv-group-size must be one of"),
                        (["--kv-bits", "4", "--distributed", "tensor"], "not supported with --distributed")]:
        res = runner.invoke(app, ["serve", "--port", "0", *args])
        assert res.exit_code == 1 and words in res.output, (args, res.output)
    res = runner.invoke(app, ["generate", "-p", "x", "--kv-bits", "4", "--distributed", "tensor"])
    assert res.exit_code == 1 and "--kv-bits is not supported with --distributed" in res.output


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_sampling_draws_from_mlx_lms_distributions_with_the_same_kv_quantization(pairs, family):
    """At temperature > 0 every token is drawn (by the lossless rule the
    sampling tests check) from the target's distribution at its position:
    under kv_bits, mlx-lm's own with the same KV quantization."""
    model, tokenizer, draft = pairs[family]
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=14)
    tokens, rows = [], []
    for r in stream_generate(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, block_size=4, temperature=0.8,
                             seed=3, logprobs=True, **kv):
        tokens += r.tokens
        rows += [r.logprobs[i] for i in range(len(r.tokens))]
    forced = iter(tokens + [0])
    want = [lp for _, lp in generate_step(mx.array(PROMPT), model, max_tokens=len(tokens),
                                          sampler=lambda _: mx.array([next(forced)]), **kv)]
    assert len(want) == len(rows) == TOKENS
    for i, (got, ref) in enumerate(zip(rows, want)):
        assert mx.allclose(got, ref, atol=1e-4).item(), f"token {i}"
