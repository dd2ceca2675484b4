"""The batch's block size (``loop/batch_policy.py``): priced per row from the
cost curve and the measured width factors, plain batched steps where drafting
does not pay at the batch's width, one row as the adaptive block alone, a
probe counted once, and the factors cached and validated like the curve."""

import importlib
import json

import pytest

from dflash_mlx.loop.batch_policy import WIDTHS, BatchBlock, BatchCosts, FixedRows, batch_costs, shaped
from dflash_mlx.loop.block_policy import AdaptiveBlock, shared_hits
from dflash_mlx.loop.cost_curve import CostCurve

CURVE = CostCurve((1, 2, 4, 8, 16), (1.1, 1.2, 1.4, 1.8, 2.6), (0.0, 0.4, 0.5, 0.7, 1.1))
SIZES = (1, 2, 4, 8, 16)
# per row, a batch of 8 pays 0.2 of a plain step but 0.9 of a block of 16: drafting stops paying
STEEPENING = BatchCosts(SIZES, ((1.0,) * 5, (0.6,) * 5, (0.35, 0.4, 0.5, 0.6, 0.7), (0.2, 0.4, 0.6, 0.8, 0.9)))


class Row:
    def __init__(self, tokens=100, left=None):
        self.tokens = [0] * tokens
        self.left = left

    def tokens_left(self):
        return self.left


def test_one_row_chooses_as_the_adaptive_block_alone():
    batch, alone = BatchBlock(CURVE, STEEPENING, 16), AdaptiveBlock(CURVE, 16)
    outcomes = [3, 15, 0, 0, 7, 2, 15, 15, 1]
    for a in outcomes:
        b = batch.choose([Row()])
        assert b == alone.choose(100, None)
        batch.update([Row()], b, [min(a, b - 1)])
        alone.update(b, min(a, b - 1))


def test_wide_batches_fall_back_to_plain_steps_where_drafting_does_not_pay():
    policy = BatchBlock(CURVE, STEEPENING, 16)
    for _ in range(20):  # every row accepts 4 drafts of 8: speculation pays for one row
        b = policy.choose([Row()])
        policy.update([Row()], b, [min(4, b - 1)])
    assert policy.choose([Row()]) > 1
    assert policy.choose([Row()] * 8) == 1
    per_row = lambda width, b: policy.costs.curve.cycle_seconds(b) * STEEPENING.factor(width, b)
    rate = lambda b: policy.block.expected_tokens(b) / per_row(8, b)
    assert all(rate(1) >= rate(b) for b in range(2, 17))


def test_a_probe_is_drafted_beside_plain_steps_and_its_rows_make_one_outcome():
    policy = BatchBlock(CURVE, BatchCosts(SIZES, ((1.0,) * 5,) * 4), 16)
    policy.block.acceptance = [0.0] * 15  # nothing pays: plain steps, then a probe falls due
    policy.block.learned = True
    policy.block.probe_warmup = 0  # past the first tokens: a probe that finds nothing counts
    rows = [Row()] * 4
    for _ in range(200):
        assert policy.choose(rows) == 1
        due = policy.probe()
        if due:
            break
        policy.update(rows, 1, [0] * 4)
    assert due > 1, "a probe must fall due"
    policy.probed(due, [[0.0], [1.0, 0.0], [0.0], [0.0]])
    assert policy.block.failed_probes == 1
    assert policy.block.acceptance[0] > 0  # one row in four accepted its first draft


def test_a_verified_probe_counts_once_however_many_rows_verify_it():
    policy = AdaptiveBlock(CURVE, 16, probe_warmup=0)
    policy.verifying_probe = True
    policy.update_rows(8, [0, 1, 0, 1])  # no row's tokens pay for the cycle
    assert policy.failed_probes == 1
    policy.verifying_probe = True
    policy.update_rows(8, [0, 3, 0, 1])  # one row's do: probes come close again
    assert policy.failed_probes == 0
    assert shared_hits([[0.0], [1.0, 1.0, 1.0, 0.0], [0.0], [1.0, 0.0]]) == [0.5, 0.5, 1.0, 0.0]


def test_fixed_rows_answers_its_block():
    policy = FixedRows(5)
    policy.update([Row()], 5, [2])
    assert policy.choose([Row()] * 3) == 5


def test_width_factors_interpolate_between_sizes_and_use_the_widest_measured_width():
    assert STEEPENING.factor(8, 12) == pytest.approx(0.85)
    assert STEEPENING.factor(16, 1) == STEEPENING.factor(8, 1)  # wider than measured: the widest
    assert STEEPENING.factor(3, 4) == STEEPENING.factor(2, 4)  # between widths: the narrower
    with pytest.raises(ValueError):
        BatchCosts(SIZES, ((1.0,) * 5,) * 3)  # a width missing
    with pytest.raises(ValueError):
        BatchCosts(SIZES, ((1.0,) * 5,) * 3 + ((0.0,) * 5,))  # a free pass


def test_measured_factors_are_held_to_the_shape_a_batch_cost_has():
    """A measurement of the demo pair at 2 rows priced b = 16 below b = 8 (0.56
    against 0.72): pooled, no width's factor falls as b grows, none rises with
    the width, none is below 1 / B; factors of that shape stay as measured."""
    physical = [[1.0] * 5, [0.6, 0.6, 0.65, 0.7, 0.8], [0.3, 0.35, 0.5, 0.6, 0.7], [0.2, 0.3, 0.45, 0.6, 0.7]]
    assert shaped(physical) == tuple(map(tuple, physical))
    noisy = [[1.0] * 5, [0.73, 0.72, 0.70, 0.72, 0.56], [0.39, 0.33, 0.36, 0.46, 0.58], [0.1, 0.23, 0.24, 0.3, 0.9]]
    got = shaped(noisy)
    assert got[1] == pytest.approx([0.686] * 5)  # one pool: every size at the mean
    assert got[2] == pytest.approx([0.36, 0.36, 0.36, 0.46, 0.58])
    assert got[3] == pytest.approx([0.125, 0.23, 0.24, 0.3, 0.58])  # 1 / 8 at least; at most 4 rows' factor
    for row, wider in zip(got, got[1:]):
        assert all(a <= b for a, b in zip(wider, wider[1:])) and all(w <= n for w, n in zip(wider, row))


def test_batch_costs_are_cached_beside_the_curve_and_a_corrupt_entry_is_measured_again(tmp_path, monkeypatch):
    bp = importlib.import_module("dflash_mlx.loop.batch_policy")  # the door names a function batch_policy
    cc = importlib.import_module("dflash_mlx.loop.cost_curve")

    measured = []

    def fake_measure(target, draft, sizes):
        measured.append(sizes)
        return BatchCosts(sizes, tuple((1.0,) * len(sizes) for _ in WIDTHS))

    class Draft:
        class config:
            block_size = 8

    monkeypatch.setattr(bp, "measure", fake_measure)
    monkeypatch.setattr(cc, "cache_key", lambda target, draft: {"pair": "p"})
    first = batch_costs(None, Draft, tmp_path)
    assert batch_costs(None, Draft, tmp_path) == first and len(measured) == 1
    assert measured[0] == (1, 2, 4, 8)  # only sizes the draft was trained for
    (path,) = (tmp_path / "batch-costs").glob("*.json")
    path.write_text(json.dumps({"schema": "x"}))
    batch_costs(None, Draft, tmp_path)
    assert len(measured) == 2


class Sampler:
    def __init__(self, greedy):
        self.greedy = greedy


def test_a_timed_batch_of_greedy_rows_is_weighed_at_the_cost_this_process_timed_at_its_width():
    """Drafting pays on the prices (every draft right); once this process
    timed speculative cycles at that width 8x dearer than priced, a timed
    batch of greedy rows runs plain steps. A batch with a sampled row, or an
    untimed policy, keeps the prices: a seed's draws follow the blocks."""
    from dflash_mlx.loop.batch_policy import BatchCycles
    from dflash_mlx.loop.drift_watch import SETTLED, times_for

    factors = BatchCosts(SIZES, ((1.0,) * 5, (0.55,) * 5, (0.5,) * 5, (0.45,) * 5))  # this test's own key
    cycles = BatchCycles(CURVE, factors, 2)
    assert cycles.cycle_seconds(8) == pytest.approx(CURVE.cycle_seconds(8) * 0.55 * 2)
    times = times_for(cycles)
    times.of(False).extend([1.0] * SETTLED)
    times.of(True).extend([8.0] * SETTLED)

    def chosen(policy, rows):
        policy.block.acceptance, policy.block.learned = [1.0] * 15, True
        return policy.choose(rows)

    greedy, sampled = Row(), Row()
    greedy.sampler, sampled.sampler = Sampler(True), Sampler(False)
    weighed = BatchBlock(CURVE, factors, 16, timed=True)
    assert chosen(weighed, [greedy, greedy]) == 1
    assert weighed.block.watch.curve == cycles and weighed.block.watch.times is times
    assert chosen(weighed, [greedy, sampled]) == 16 and weighed.block.watch is None
    assert chosen(BatchBlock(CURVE, factors, 16), [greedy, greedy]) == 16
