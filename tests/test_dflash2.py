"""DFlash2 drafts load in z-lab's layout and ours, run through the same loop
as v1 drafts (a second proposer), and stay token-identical to mlx-lm's greedy
output, with the selector's walk choosing the drafts, at every acceptance
length; DDTree builds its tree from the selector's transitions."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from checkpoints import write_dflash2_draft
from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.loop.decoder import DFlash2Proposer, SpeculativeDecoder, proposer_for
from dflash_mlx.draft import DFlash2Draft, DFlashDraft
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams

FAMILIES = ["llama", "qwen3", "qwen3_5"]
BLOCK = 8
PUBLISHED = dict(layer_types=["sliding_attention"] * 2, sliding_window=6, is_causal=False)


@pytest.fixture(scope="module")
def dflash2_dirs(tmp_path_factory, target_dirs):
    """(family, layout) -> directory of a DFlash2 draft in the published shape
    (every layer sliding, is_causal false)."""
    out = {}
    for family in FAMILIES:
        config = json.loads((target_dirs[family] / "config.json").read_text())
        for layout in ("hf", "mlx"):
            path = tmp_path_factory.mktemp(f"dflash2-{family}-{layout}")
            write_dflash2_draft(path, config, layout=layout, block_size=BLOCK, **PUBLISHED)
            out[family, layout] = path
    return out


@pytest.fixture(scope="module")
def loaded(target_dirs, dflash2_dirs):
    """family -> (mlx-lm model, tokenizer, DFlash2 draft in z-lab's layout)."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        out[family] = (model, tokenizer, load_draft(str(dflash2_dirs[family, "hf"])))
    return out


def greedy_reference(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def test_both_layouts_load_as_dflash2_with_the_same_weights(dflash2_dirs, draft_dir):
    hf = load_draft(str(dflash2_dirs["qwen3", "hf"]))
    ours = load_draft(str(dflash2_dirs["qwen3", "mlx"]))
    assert isinstance(hf, DFlash2Draft) and isinstance(ours, DFlash2Draft)
    assert hf.config == ours.config and hf.config.block_size == BLOCK
    assert (hf.config.selector_top_k, hf.config.conv_kernel_size, hf.config.is_causal) == (4, 2, False)
    a, b = dict(hf.parameters()["candidate_selector"]), dict(ours.parameters()["candidate_selector"])
    for name in ("predecessor_codebook", "successor_codebook"):
        assert mx.array_equal(a[name]["weight"], b[name]["weight"]).item()
    v1 = load_draft(str(draft_dir("qwen3")))
    assert type(v1) is DFlashDraft  # a v1 draft stays a v1 draft


def test_broken_dflash2_drafts_are_refused_with_one_line(tmp_path, target_dirs):
    config = json.loads((target_dirs["qwen3"] / "config.json").read_text())
    missing = tmp_path / "missing"
    write_dflash2_draft(missing, config, omit=("fc.weight",))
    with pytest.raises(DFlashError, match="cannot load draft") as e:
        load_draft(str(missing))
    assert "\n" not in str(e.value)
    no_top_k = tmp_path / "no-top-k"
    cfg = write_dflash2_draft(no_top_k, config)
    del cfg["dflash_config"]["selector_top_k"]
    (no_top_k / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="selector_top_k"):
        load_draft(str(no_top_k))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_mlx_lm_greedy_output(loaded, family):
    model, tokenizer, draft = loaded[family]
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 24)
    for block_size in (2, BLOCK):
        got = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size).tokens
        assert got == want


def test_auto_block_runs_the_dflash2_proposer(loaded):
    model, tokenizer, draft = loaded["qwen3"]
    ids = tokenizer.encode("hello")
    res = generate(model, draft, tokenizer, ids, max_tokens=24, block_size="auto")
    assert res.tokens == greedy_reference(model, ids, 24)
    assert set(res.block_sizes) <= set(range(1, BLOCK + 1))


class SteeredProposer(DFlash2Proposer):
    """The real DFlash2 proposer and selector walk, with its logits pushed
    towards the target's greedy continuation (corrupted at one row), so every
    acceptance length happens."""

    def __init__(self, draft, target, prompt_len, continuation, corrupt_at):
        super().__init__(draft, target)
        self.position, self.prompt_len = 0, prompt_len
        self.continuation, self.corrupt_at = continuation, corrupt_at

    def observe(self, features, tokens):
        self.position += tokens.size
        super().observe(features, tokens)

    def skip(self, tokens):  # prompt positions the sliding windows will not see
        self.position += tokens.size
        super().skip(tokens)

    def _rows(self, y, block_size):
        hidden, logits = super()._rows(y, block_size)
        start = self.position - self.prompt_len + 1
        tokens = list(self.continuation[start : start + block_size - 1])
        if self.corrupt_at is not None:
            tokens[self.corrupt_at] = (tokens[self.corrupt_at] + 1) % logits.shape[-1]
        push = (mx.arange(logits.shape[-1])[None] == mx.array(tokens)[:, None]) * 1000.0
        return hidden, logits + push


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_every_acceptance_length_stays_lossless(loaded, family):
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 3 * BLOCK + 2)
    for corrupt_at in [*range(BLOCK - 1), None]:
        proposer = SteeredProposer(draft, target, len(prompt), continuation, corrupt_at)
        decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, BLOCK)
        out = [decoder.prefill(mx.array(prompt))]
        for _ in range(2):
            cycle = decoder.cycle()
            assert cycle.accepted == (BLOCK - 1 if corrupt_at is None else corrupt_at)
            out += cycle.tokens
            assert out == continuation[: len(out)]
            # the draft's context holds the committed positions only, never the block
            assert {c.offset for c in proposer.cache} == {len(decoder.tokens)}


def test_the_proposer_follows_the_architecture(loaded, draft_dir):
    model, _, draft = loaded["qwen3"]
    target = Target(model)
    assert type(proposer_for(draft, target)) is DFlash2Proposer
    assert type(proposer_for(load_draft(str(draft_dir("qwen3"))), target)) is not DFlash2Proposer


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_tree_decoding_with_dflash2_is_mlx_lm_greedy(loaded, family):
    model, tokenizer, draft = loaded[family]
    ids = tokenizer.encode("the quick brown fox")
    got = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=BLOCK, tree_budget=8).tokens
    assert got == greedy_reference(model, ids, 24)
    sampled = lambda seed: generate(model, draft, tokenizer, ids, max_tokens=16, block_size=BLOCK, tree_budget=8,
                                    temperature=1.0, seed=seed).tokens
    assert sampled(1) == sampled(1) and len(sampled(1)) == 16 and sampled(1) != sampled(2)


class FlatProposer(DFlash2Proposer):
    """The real proposer with its logits flattened, so that the transition
    term decides the rankings (the tiny target's logits would drown it)."""

    def _rows(self, y, block_size):
        hidden, logits = super()._rows(y, block_size)
        return hidden, logits * 0.01


def test_the_tree_follows_the_selector(loaded):
    """Each node's children are the best of its depth's candidates ranked by
    the transition from the node's own token, so the tree's chain of best
    children is the selector's greedy walk; steered drafts are accepted along it."""
    from dflash_mlx.tree import TreeDecoder
    from dflash_mlx.tree.build import build_transition_tree

    model, tokenizer, draft = loaded["qwen3_5"]
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    proposer = FlatProposer(draft, target)
    proposer.observe(mx.random.normal((1, len(prompt), 2 * target.hidden_size), key=mx.random.key(0)), None)
    y = mx.array([prompt[-1]])
    candidates, logprobs = proposer.tree_candidates(y, BLOCK)
    walk, _ = proposer.draft_block(y, BLOCK, BlockSampler(SamplingParams()))
    C, L = candidates.tolist(), logprobs.tolist()
    tree = build_transition_tree(y.item(), C, L, 40)
    kids = tree.children()
    rankings = set()
    for node in range(len(tree)):
        d = tree.depths[node]
        if not kids[node]:
            continue
        slot = 0 if d == 0 else C[d - 1].index(tree.tokens[node])
        ranking = sorted(C[d], key=lambda t: -L[d][slot][C[d].index(t)])
        assert list(kids[node]) == ranking[: len(kids[node])], "children are not the node's best candidates"
        rankings.add(tuple(ranking))
    assert len(rankings) > 2, "the parents' rankings must differ for this to bite"
    node, chain = 0, []
    while kids[node]:
        best = next(iter(kids[node]))
        chain.append(best)
        node = kids[node][best]
    assert len(chain) >= 3 and chain == walk.tolist()[: len(chain)]

    continuation = greedy_reference(model, prompt, 3 * BLOCK + 2)
    steered = SteeredProposer(draft, target, len(prompt), continuation, None)
    decoder = TreeDecoder(target, steered, draft.config.target_layer_ids, BLOCK, 8)
    out = [decoder.prefill(mx.array(prompt))]
    for _ in range(2):
        cycle = decoder.cycle()
        assert cycle.accepted == BLOCK - 1
        out += cycle.tokens
    assert out == continuation[: len(out)]


def test_the_registry_pairs_qwen3_8_with_its_dflash2_draft():
    from dflash_mlx.registry import find_draft

    for name in ("Qwen/Qwen3.8-27B", "mlx-community/Qwen3.8-27B-4bit"):
        assert find_draft(name) == "z-lab/Qwen3.8-27B-DFlash2"


def test_the_cli_generates_with_a_dflash2_draft(target_dirs, dflash2_dirs):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    target, draft = str(target_dirs["qwen3"]), str(dflash2_dirs["qwen3", "hf"])
    model, tokenizer = mlx_lm_load(target)
    want = tokenizer.decode(greedy_reference(model, tokenizer.encode("the quick brown fox"), 16)).strip()
    for extra in (["--block-size", "4"], ["--tree-budget", "4"]):
        result = CliRunner().invoke(app, ["generate", "--model", target, "--draft", draft, "--prompt",
                                          "the quick brown fox", "--max-tokens", "16", "--no-chat-template", *extra])
        assert result.exit_code == 0, result.stderr
        assert result.stdout.strip() == want
