"""bench --synthetic: the oracle accepts what its mode says (fast, tiny target),
and on the ~200M-parameter target the loop keeps at least 90% of the ideal
speedup (slow: a benchmark, excluded from the default run)."""

import pytest

from dflash_mlx.bench.synthetic import MODES, main_synthetic, run_synthetic, synthetic_target

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def test_the_oracle_is_right_for_its_share_of_each_block():
    rows = run_synthetic([5, 9], max_tokens=40, model=synthetic_target(**TINY))
    tau = {(r.mode, r.block_size): r.tau for r in rows}
    assert [(r.mode, r.block_size) for r in rows] == [(m, b) for b in (5, 9) for m in MODES]
    # the last cycle may be cut short by max_tokens, so tau sits at or just below b * share + 1
    for b in (5, 9):
        assert tau["none", b] == 1.0
        assert round(0.5 * (b - 1)) + 1 - 0.5 <= tau["half", b] <= round(0.5 * (b - 1)) + 1
        assert b - 1.5 <= tau["full", b] <= b
    assert all(r.ar_tps > 0 and r.dflash_tps > 0 and r.t_verify_ms > 0 for r in rows)


@pytest.mark.slow
def test_the_loop_keeps_90_percent_of_the_ideal_speedup():
    rows = main_synthetic([4, 16], max_tokens=128)
    low = [(r["mode"], r["block_size"], round(r["efficiency"], 3)) for r in rows if r["efficiency"] < 0.9]
    assert not low, f"loop efficiency below 0.9: {low}"


def test_the_oracle_runs_after_a_long_prompt():
    rows = run_synthetic([4], max_tokens=20, model=synthetic_target(**TINY), context=300)
    assert [(r.context, r.mode) for r in rows] == [(300, m) for m in MODES]
    tau = {r.mode: r.tau for r in rows}
    assert tau["none"] == 1.0 and 2.5 <= tau["full"] <= 4


@pytest.mark.slow
def test_the_loop_keeps_90_percent_of_the_ideal_speedup_at_8k_and_16k_context():
    rows = main_synthetic([4, 16], max_tokens=64, contexts=[8192, 16384])
    low = [(r["context"], r["mode"], r["block_size"], round(r["efficiency"], 3))
           for r in rows if r["efficiency"] < 0.9]
    assert not low, f"loop efficiency below 0.9: {low}"
