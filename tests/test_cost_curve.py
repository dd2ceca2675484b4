"""The cost curve: interpolation, a real measurement of a tiny pair, and the
on-disk cache (re-measured when corrupt or stale, one entry per key). No
timing is asserted: only that figures exist, are valid and are reused."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import Target, load_draft
from dflash_mlx.loop import cost_curve as cc
from dflash_mlx.loop.cost_curve import CostCurve
from dflash_mlx.loop.drift_watch import DriftWatch, Watched

SYNTHETIC = CostCurve((1, 2, 4, 8), (1.0, 2.0, 4.0, 6.0), (0.0, 1.0, 3.0, 5.0))


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    return Target(model), load_draft(str(draft_dir("qwen3", block_size=8)))


@pytest.fixture
def counted(monkeypatch):
    """Replace the measurement by the synthetic curve; returns the call list."""
    calls = []

    def fake(target, draft, sizes, budget_s=cc.BUDGET_S):
        calls.append(sizes)
        return SYNTHETIC

    monkeypatch.setattr(cc, "measure", fake)
    return calls


def test_interpolates_between_and_beyond_the_measured_sizes():
    assert SYNTHETIC.target(3) == 3.0 and SYNTHETIC.draft(3) == 2.0
    assert SYNTHETIC.target(6) == 5.0 and SYNTHETIC.draft(6) == 4.0
    assert SYNTHETIC.target(10) == 7.0  # the last segment's slope
    assert SYNTHETIC.draft(1) == 0.0 and SYNTHETIC.cycle_seconds(1) == 1.0  # no draft pass
    assert SYNTHETIC.cycle_seconds(4) == 7.0
    assert CostCurve.from_dict(SYNTHETIC.to_dict()) == SYNTHETIC


@pytest.mark.parametrize("bad", [
    dict(sizes=(2, 4), target_s=(1.0, 2.0), draft_s=(1.0, 2.0)),  # no b = 1
    dict(sizes=(1, 4, 2), target_s=(1.0, 2.0, 3.0), draft_s=(0.0, 1.0, 1.0)),  # not increasing
    dict(sizes=(1, 2), target_s=(1.0, float("nan")), draft_s=(0.0, 1.0)),
    dict(sizes=(1, 2), target_s=(1.0, 2.0), draft_s=(0.0, -1.0)),
    dict(sizes=(1, 2), target_s=(1.0, 2.0), draft_s=(0.5, 1.0)),  # a draft pass at b = 1
    dict(sizes=(1, 2), target_s=(1.0,), draft_s=(0.0, 1.0)),
])
def test_invalid_curves_are_refused(bad):
    with pytest.raises(ValueError):
        CostCurve(**bad)


def test_sizes_fit_the_trained_block():
    assert cc.sizes_for(16) == (1, 2, 4, 8, 12, 16)
    assert cc.sizes_for(10) == (1, 2, 4, 8, 10)
    assert cc.sizes_for(2) == (1, 2)


def test_a_real_measurement_gives_a_valid_curve_over_the_trained_sizes(pair, tmp_path):
    target, draft = pair
    curve = cc.cost_curve(target, draft, tmp_path)
    assert curve.sizes == (1, 2, 4, 8)
    assert all(t > 0 for t in curve.target_s) and all(d > 0 for d in curve.draft_s[1:])
    assert len(curve.target_slope) == len(curve.draft_slope) == 4 and curve.context == cc.CONTEXT
    assert min(curve.target_slope + curve.draft_slope) >= 0 and curve.inject_s > 0
    assert cc.cost_curve(target, draft, tmp_path) == curve  # read back, not measured again


def test_the_loops_cycles_are_timed_in_runs_between_plain_steps_each_price_their_median(pair):
    """Each size runs between runs of plain steps, and only a cycle with its
    own block on both sides is timed: no switch is in a price, and one
    held-up cycle does not move it."""
    from dflash_mlx.loop.decoder import SpeculativeDecoder, proposer_for

    target, draft = pair
    decoder = SpeculativeDecoder(target, proposer_for(draft, target), draft.config.target_layer_ids, 1)
    decoder.prefill(mx.arange(40, dtype=mx.int32))
    ran, cycle = [], decoder.cycle

    def logged():
        ran.append(decoder.block_size)
        return cycle()

    decoder.cycle = logged
    now = [0.0]

    def clock():  # a cycle at b takes b seconds, but the third plain step of all, held up, 100
        if ran:
            now[0] += 100.0 if len(ran) == 3 else ran[-1]
        return now[0]

    prices = cc.loop_cycle_seconds(decoder, (1, 2, 4), rounds=2, clock=clock)
    assert prices == {1: 1.0, 2: 2.0, 4: 4.0}
    script = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 4, 4, 4, 4] * 2
    assert ran == ([1] + script)[: len(script)]  # the prefill queued a plain step; the last block is only queued
    assert decoder.proposer.cache[0].offset == len(decoder.tokens)  # closed: every position injected
    assert len(decoder.tokens) <= 40 + cc.fed_past_context((1, 2, 4))


def test_cached_once_then_reused(pair, tmp_path, counted):
    target, draft = pair
    assert cc.cost_curve(target, draft, tmp_path) == SYNTHETIC
    assert cc.cost_curve(target, draft, tmp_path) == SYNTHETIC
    assert len(counted) == 1
    files = list((tmp_path / "cost-curves").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["curve"] == SYNTHETIC.to_dict()


@pytest.mark.parametrize("garbage", [
    "not json {", "", "[]", '{"schema": "dflash-mlx-cost-curve"}',
    lambda e: {**e, "curve": {**e["curve"], "target_s": [1.0, -2.0, 3.0, 4.0]}},  # invalid curve
    lambda e: {**e, "key": {**e["key"], "dflash_mlx": "0.0.0-older"}},  # stale: another version
    lambda e: {**e, "schema_version": 0},
])
def test_a_corrupt_or_stale_entry_is_measured_again_and_rewritten(pair, tmp_path, counted, garbage):
    target, draft = pair
    cc.cost_curve(target, draft, tmp_path)
    path = cc.cache_path(cc.cache_key(target, draft), tmp_path)
    entry = json.loads(path.read_text())
    path.write_text(garbage if isinstance(garbage, str) else json.dumps(garbage(entry)))
    assert cc.cost_curve(target, draft, tmp_path) == SYNTHETIC
    assert len(counted) == 2
    assert cc.read_cached(path, cc.cache_key(target, draft)) == SYNTHETIC  # rewritten, valid


def test_refresh_measures_again(pair, tmp_path, counted):
    target, draft = pair
    cc.cost_curve(target, draft, tmp_path)
    cc.cost_curve(target, draft, tmp_path, refresh=True)
    assert len(counted) == 2


def test_another_key_gets_its_own_entry(pair, target_dirs, draft_dir, tmp_path, counted):
    target, draft = pair
    other_draft = load_draft(str(draft_dir("qwen3", block_size=4)))
    model16, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    model16.set_dtype(mx.float16)
    keys = [cc.cache_key(target, draft), cc.cache_key(target, other_draft),
            cc.cache_key(Target(model16), draft)]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3
    cc.cost_curve(target, draft, tmp_path)
    cc.cost_curve(target, other_draft, tmp_path)
    cc.cost_curve(Target(model16), draft, tmp_path)
    assert len(counted) == 3 and counted[1] == (1, 2, 4)
    assert len(list((tmp_path / "cost-curves").glob("*.json"))) == 3
    cc.cost_curve(target, draft, tmp_path)
    assert len(counted) == 3  # the first entry survived the others


def test_a_column_never_prices_a_larger_pass_below_a_smaller_one():
    sizes = (1, 2, 4, 8, 12, 16)
    seconds = dict(zip(sizes, (3.8, 10.7, 12.3, 14.7, 18.9, 12.5)))  # a re-measure on a busy machine
    table = {(b, "target"): t for b, t in seconds.items()} | {(b, "draft"): 1.0 for b in sizes if b > 1}
    assert cc.pass_column(table, "target", sizes) == (3.8, 10.7, 12.3, 14.7, 18.9, 18.9)
    assert cc.pass_column(table, "draft", sizes) == (0.0, 1.0, 1.0, 1.0, 1.0, 1.0)


def test_the_blas_thread_count_gets_its_own_entry(pair, monkeypatch):
    target, draft = pair
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    default = cc.cache_key(target, draft)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    one = cc.cache_key(target, draft)
    assert one != default and one["device"]["blas_threads"] == {"OPENBLAS_NUM_THREADS": "1"}


def test_the_cache_directory_follows_the_environment(pair, tmp_path, monkeypatch, counted):
    target, draft = pair
    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path / "env"))
    cc.cost_curve(target, draft)
    assert len(list((tmp_path / "env" / "cost-curves").glob("*.json"))) == 1
    monkeypatch.delenv("DFLASH_MLX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir() == tmp_path / "xdg" / "dflash-mlx"


def test_an_unwritable_cache_still_gives_the_curve(pair, tmp_path, counted):
    target, draft = pair
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cc.cost_curve(target, draft, blocker) == SYNTHETIC  # cache_dir is a file: not cached


def test_bench_calibrate_prints_the_curve_and_caches_it(target_dirs, draft_dir, tmp_path, monkeypatch, counted):
    from rich.console import Console

    from dflash_mlx.bench.calibrate import main_calibrate

    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    out, err = Console(record=True, width=200), Console(record=True, width=400)
    curve = main_calibrate(model=str(target_dirs["qwen3"]), draft=str(draft_dir("qwen3", block_size=8)),
                           dtype="auto", out=out, err=err)
    assert curve == SYNTHETIC
    rows = [line.split("│")[1:-1] for line in out.export_text().splitlines() if line.startswith("│")]
    assert [[c.strip() for c in r] for r in rows] == [
        ["1", "1000.00", "-", "1000.00", "1.00", "0.00"], ["2", "2000.00", "1000.00", "3000.00", "3.00", "0.00"],
        ["4", "4000.00", "3000.00", "7000.00", "7.00", "0.00"], ["8", "6000.00", "5000.00", "11000.00", "11.00", "0.00"]]
    assert len(list((tmp_path / "cost-curves").glob("*.json"))) == 1
    said = err.export_text()
    assert "cached in" in said and "measured in" in said and "held after" in said
    main_calibrate(model=str(target_dirs["qwen3"]), draft=str(draft_dir("qwen3", block_size=8)),
                   dtype="auto", out=out, err=err)
    assert len(counted) == 2  # --calibrate always measures afresh


# measured at 100 tokens: each pass grows by its slope per token past them
CONTEXTUAL = CostCurve((1, 2, 4), (1.0, 2.0, 4.0), (0.0, 1.0, 3.0), 100, (0.01, 0.02, 0.04), (0.0, 0.1, 0.1), 0.5)


def test_the_curve_grows_with_the_context_by_its_slopes():
    assert CONTEXTUAL.target(2, 300) == pytest.approx(2.0 + 0.02 * 200)
    assert CONTEXTUAL.target(3, 300) == pytest.approx(3.0 + 0.03 * 200)  # the slope interpolated too
    assert CONTEXTUAL.draft(4, 1100) == pytest.approx(3.0 + 0.1 * 1000)
    assert CONTEXTUAL.target(2, 50) == CONTEXTUAL.target(2) == 2.0  # never below the measured context
    assert CONTEXTUAL.cycle_seconds(1, 300) == pytest.approx(1.0 + 2.0 + 0.5)  # a plain step and its injection
    assert CONTEXTUAL.cycle_seconds(2, 300) == pytest.approx(6.0 + 21.0)
    from rich.console import Console

    from dflash_mlx.bench.calibrate import print_curve

    out = Console(record=True, width=200)
    print_curve(CONTEXTUAL, out, "t")
    text = out.export_text()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]
    assert rows[0] == ["1", "1000.00", "-", "1500.00", "1.00", "10000.00"]  # 0.01 s per token: 10 s per 1k
    assert "at 100 tokens of context" in text
    assert CostCurve.from_dict(json.loads(json.dumps(CONTEXTUAL.to_dict()))) == CONTEXTUAL
    assert SYNTHETIC.target(2, 10**6) == SYNTHETIC.target(2)  # no slopes: context-blind
    with pytest.raises(ValueError):
        CostCurve((1, 2), (1.0, 2.0), (0.0, 1.0), 64, (0.01,), ())  # a slope per size, or none
    with pytest.raises(ValueError):
        CostCurve((1, 2), (1.0, 2.0), (0.0, 1.0), 64, (0.01, -0.01), ())


def test_slopes_are_one_line_over_the_sizes():
    assert cc.slope_line((1, 2, 4), (1.0, 2.0, 4.0)) == pytest.approx((1.0, 2.0, 4.0))  # on the line
    noisy = cc.slope_line((2, 4, 8, 16), (3.0, 0.0, 9.0, 15.0))  # one timing low
    assert all(b > a for a, b in zip(noisy, noisy[1:])) and min(noisy) > 0
    assert cc.slope_line((2, 4, 8), (5.0, 1.0, -3.0)) == pytest.approx((1.0, 1.0, 1.0))  # no negative growth
    assert cc.slope_line((2, 4, 8), (-1.0, -1.0, -2.0)) == (0.0, 0.0, 0.0)
    assert cc.slope_line((2,), (0.5,)) == (0.5,)


def _scripted_passes(monkeypatch, plain_ms):
    """Replace the pass timings by tables whose plain step takes the next of
    ``plain_ms`` per call (near, far, near, far, ...); each pass at b > 1
    takes 10 + b ms, b ms more at the long context. Returns the contexts timed."""
    timed, plain = [], iter(plain_ms)

    def passes(target, draft, sizes, context, budget_s):
        timed.append(context)
        far = context > cc.CONTEXT
        table = {(b, kind): (10 + b + far * b) * 1e-3 for b in sizes if b > 1 for kind in ("target", "draft")}
        table[1, "target"] = next(plain) * 1e-3
        return table

    monkeypatch.setattr(cc, "_pass_seconds", passes)
    return timed


def test_a_plain_step_timed_faster_over_the_long_context_is_timed_again(pair, monkeypatch):
    """A held-up short-context timing would price the context at nothing: the
    pair is timed again, and the first consistent measurement is the curve."""
    target, draft = pair
    sizes = (1, 2, 4, 8)
    far = cc.long_context(target, sizes)
    timed = _scripted_passes(monkeypatch, [8.0, 5.0, 4.0, 5.0, 9.0, 1.0])
    curve = cc.measure(target, draft, sizes)
    assert timed == [cc.CONTEXT, far] * 2  # held up once, then consistent
    assert curve.target_s[0] == pytest.approx(4e-3)
    assert curve.target_slope[0] == pytest.approx(1e-3 / (far - cc.CONTEXT))
    timed = _scripted_passes(monkeypatch, [8.0, 5.0] * cc.MEASURE_TRIES)
    held_up = cc.measure(target, draft, sizes)
    assert len(timed) == 2 * cc.MEASURE_TRIES  # never consistent: the last is kept
    assert held_up.target_s[0] == pytest.approx(8e-3)
    timed = _scripted_passes(monkeypatch, [8.0, 5.0, 4.0, 5.0])
    cc.measure(target, draft, sizes, agree=lambda consistent: True)  # another rank's verdict rules
    assert len(timed) == 2


def test_the_long_context_fits_the_targets_positions(pair):
    target, _ = pair
    sizes = (1, 2, 4, 8)
    positions = target.args.max_position_embeddings
    n = cc.long_context(target, sizes)
    assert n == min(cc.LONG_CONTEXT, positions - cc.fed_past_context(sizes))
    assert n + cc.fed_past_context(sizes) <= positions
    target.args.max_position_embeddings, saved = 200, target.args.max_position_embeddings
    try:
        assert cc.long_context(target, sizes) is None  # too short to tell a slope from the noise
    finally:
        target.args.max_position_embeddings = saved


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _cycles(watch, clock, seconds, blocks, context=100):
    for b in blocks:
        clock.now += seconds(b)
        watch.cycle_done(b, context)


def test_cycles_near_the_curve_are_no_drift():
    clock, drifted = Clock(), []
    watch = DriftWatch(CONTEXTUAL, lambda: drifted.append(True), clock, window=8)
    _cycles(watch, clock, lambda b: 1.3 * CONTEXTUAL.cycle_seconds(b, 100), [1, 1, 2] * 20)
    assert not drifted and watch.factor(1) == watch.factor(2) == 1.0


def test_drifted_plain_steps_are_measured_again_and_rescaled_meanwhile():
    """t(1) doubles under load while the speculative cycles keep to the curve:
    the watch says so once, and the policy weighs the cycles as observed."""
    from dflash_mlx.loop.block_policy import AdaptiveBlock

    clock, drifted = Clock(), []
    watch = DriftWatch(CONTEXTUAL, lambda: drifted.append(True), clock, window=8)
    slowed = lambda b: CONTEXTUAL.cycle_seconds(b, 100) * (2.0 if b == 1 else 1.0)  # noqa: E731
    _cycles(watch, clock, slowed, [1] * 7 + [2, 2, 2])
    assert not drifted  # seven plain steps timed: not yet a window's worth
    _cycles(watch, clock, slowed, [1] * 3)
    assert drifted == [True] and watch.factor(1) == 2.0 and watch.factor(2) == 1.0
    _cycles(watch, clock, slowed, [1] * 20)
    assert drifted == [True]  # once
    fresh = DriftWatch(CONTEXTUAL, None, clock, window=8)
    _cycles(fresh, clock, slowed, [1] * 9)
    assert fresh.drifted and fresh.factor(1) == 2.0 and fresh.factor(2) == 1.0  # not yet timed: tried as priced
    curve = CostCurve((1, 2), (1.0, 2.2), (0.0, 0.1))  # b = 2 nearly pays at tau 1.6 ...
    policy = AdaptiveBlock(curve, 2, watch=watch)
    assert AdaptiveBlock(curve, 2).choose() == 1
    assert policy.choose() == 2  # ... and does once plain steps cost twice as much


def test_a_sampled_generation_is_told_of_drift_but_keeps_the_curves_prices(pair):
    """A seed's draws follow the blocks, so a sampled generation's blocks must
    not follow timings: its watch still forgets the drifted curve, and its
    factors stay 1; ``stream_generate`` gives a sampled generation such a watch."""
    clock, drifted = Clock(), []
    watch = DriftWatch(CONTEXTUAL, lambda: drifted.append(True), clock, window=8, rescale=False)
    slowed = lambda b: CONTEXTUAL.cycle_seconds(b, 100) * (2.0 if b == 1 else 1.0)  # noqa: E731
    _cycles(watch, clock, slowed, [1] * 12)
    assert drifted == [True] and watch.factor(1) == 1.0 and watch.factor(2) == 1.0
    from dflash_mlx.generate import auto_policy

    target, draft = pair
    assert not auto_policy(target, draft, Watched(SYNTHETIC), sampled=True).watch.rescale
    assert auto_policy(target, draft, Watched(SYNTHETIC)).watch.rescale


def test_a_greedy_generation_weighs_the_cycles_this_process_timed_on_the_curve(pair):
    """Each kind is weighed as observed once ``SETTLED`` of its cycles were
    timed on the curve, by this watch or any greedy one before it; a kind
    timed fewer times follows the other; a sampled watch neither weighs nor
    records, and ``auto_policy`` shares the times only between greedy ones."""
    from dflash_mlx.generate import auto_policy
    from dflash_mlx.loop.drift_watch import SETTLED, CycleTimes, times_for

    clock, times = Clock(), CycleTimes()
    faster = 2**-0.375  # within the drift tolerance, on the factors' 1/8-octave grid
    timed = lambda b: CONTEXTUAL.cycle_seconds(b, 100) * (faster if b > 1 else 1.0)  # noqa: E731
    first = DriftWatch(CONTEXTUAL, None, clock, window=8, times=times)
    _cycles(first, clock, timed, [2] * SETTLED)  # the first cycle only starts the clock
    assert first.factors == (1.0, 1.0)
    _cycles(first, clock, timed, [2])
    assert first.factors == pytest.approx((faster, faster))  # plain steps untimed: off as far as speculation
    _cycles(first, clock, timed, [1] * SETTLED)
    assert first.factors == pytest.approx((1.0, faster)) and not first.drifted
    later = DriftWatch(CONTEXTUAL, None, clock, window=8, times=times)
    assert later.factors == pytest.approx((1.0, faster))  # from the first cycle on
    sampled = DriftWatch(CONTEXTUAL, None, clock, window=8, rescale=False, times=times)
    _cycles(sampled, clock, lambda b: 1.3 * CONTEXTUAL.cycle_seconds(b, 100), [2] * 20)
    assert sampled.factors == (1.0, 1.0) and len(times.of(True)) == SETTLED
    target, draft = pair
    assert auto_policy(target, draft, Watched(CONTEXTUAL)).watch.times is times_for(CONTEXTUAL)
    assert auto_policy(target, draft, Watched(CONTEXTUAL), sampled=True).watch.times is None


def test_a_watched_curve_is_watched_in_each_generation_and_never_forgotten(pair, target_dirs, tmp_path, monkeypatch,
                                                                          counted):
    """What bench hands its auto runs: the curve as given (nothing measured or
    read), a fresh watch per generation with nothing to forget; a bare curve
    is taken as it is, unwatched (ranks of a distributed run decide alike)."""
    from dflash_mlx.generate import auto_policy, generate

    target, draft = pair
    watched = [auto_policy(target, draft, Watched(CONTEXTUAL)) for _ in range(2)]
    assert all(p.costs is CONTEXTUAL and p.watch.curve is CONTEXTUAL and p.watch.on_drift is None for p in watched)
    assert watched[0].watch is not watched[1].watch
    assert auto_policy(target, draft, CONTEXTUAL).watch is None
    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    _, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    got = generate(target.model, draft, tokenizer, [3, 4, 5], max_tokens=8, cost_curve=Watched(CONTEXTUAL))
    assert len(got.tokens) == 8 and not counted and not list(tmp_path.iterdir())


def test_forget_removes_the_cached_curve_once_per_process(pair, tmp_path, counted):
    target, draft = pair
    cc.cost_curve(target, draft, tmp_path)
    cc.forget(target, draft, tmp_path)
    cc.cost_curve(target, draft, tmp_path)
    assert len(counted) == 2
    cc.forget(target, draft, tmp_path)  # drifted again: this run's watch rescales, the curve stays
    cc.cost_curve(target, draft, tmp_path)
    assert len(counted) == 2


def test_every_rank_gets_the_whole_curve():
    """Rank 0's curve crosses the group whole: its context slopes and injection price too."""
    from dflash_mlx.distributed import shared_cost_curve

    curve = CostCurve((1, 2, 4), (1.0, 2.0, 4.0), (0.0, 1.0, 3.0), 100, (0.25, 0.5, 0.75), (0.0, 0.125, 0.125), 0.5)
    assert shared_cost_curve(None, None, mx.distributed.init(), curve) == curve  # values exact in float32
