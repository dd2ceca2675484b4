"""The registry: every published draft's target family is one dflash-mlx runs or
is listed with the reason it cannot; sizes and fit; ``dflash-mlx models``."""

import importlib

import pytest
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.cli import app
from dflash_mlx.registry import (DISTRIBUTED_FAMILIES, DSPARK_DRAFTS, KNOWN_PAIRS, UNSUPPORTED_PAIRS, find_draft,
                                 fitting, listing, memory_budget, resolve_pair, weights_gb)
from dflash_mlx.targets import SUPPORTED_MODEL_TYPES


def test_every_entry_runs_here_or_says_why_not():
    for target, draft in [*KNOWN_PAIRS.items(), *DSPARK_DRAFTS.items()]:
        assert draft.model_type in SUPPORTED_MODEL_TYPES, target
        assert draft.unsupported is None and draft.params_b > 0, target
    for target, draft in UNSUPPORTED_PAIRS.items():
        assert draft.model_type not in SUPPORTED_MODEL_TYPES, target
        assert draft.model_type in draft.unsupported, target
    assert not set(KNOWN_PAIRS) & set(UNSUPPORTED_PAIRS)


@pytest.mark.parametrize("target, draft", [
    ("google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash"),
    ("mlx-community/Qwen3.5-122B-A10B-4bit", "z-lab/Qwen3.5-122B-A10B-DFlash"),
    ("Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash"),
    ("moonshotai/Kimi-K2.5", None),
    ("mlx-community/Qwen3-14B-4bit", "deepseek-ai/dspark_qwen3_14b_block7"),  # its only draft is DSpark's
    ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),  # a DFlash draft stays the default beside DSpark's
    ("mlx-community/LFM2.5-1.2B-Instruct-8bit", "LiquidAI/LFM2.5-1.2B-Instruct-DSpark"),  # LiquidAI's own
    ("LiquidAI/LFM2.5-24B-A2B", "LiquidAI/LFM2.5-24B-A2B-DSpark"),
])
def test_new_entries_resolve(target, draft):
    assert find_draft(target) == draft


def test_a_target_that_cannot_run_is_refused_with_its_reason():
    with pytest.raises(DFlashError, match="cannot run: no target adapter for mlx-lm's 'kimi_k25'") as e:
        resolve_pair("mlx-community/Kimi-K2.5-4bit", None)
    assert "\n" not in str(e.value)


def test_sizes_and_fit_follow_the_bits_per_weight():
    assert weights_gb(27, 16) == pytest.approx(54)
    assert weights_gb(27, 4.5) == pytest.approx(15.1875)
    gb = 10**9
    assert fitting(27, 50 * gb) == "8-bit"  # 28.7 GB * 1.1 fits, 54 GB * 1.1 does not
    assert fitting(27, 17 * gb) == "4-bit"
    assert fitting(27, 16 * gb) == "8-bit on 2 Macs"  # sharded: 31.6 GB over two of 16 GB
    assert fitting(397, 192 * gb) == "4-bit on 2 Macs"  # 245.6 GB with 10% spare: two 192 GB Macs
    assert fitting(397, 512 * gb) == "8-bit"  # one 512 GB M3 Ultra holds 8 bits (464 GB)
    assert fitting(397, 32 * gb) == "no"  # not even 4 Macs of 32 GB
    assert fitting(27, 16 * gb, max_machines=1) == "no"  # a family that cannot be sharded
    assert fitting(27, None) == "?"
    assert memory_budget({"memory_size": 64 * gb, "max_recommended_working_set_size": 50 * gb}) == 50 * gb
    assert memory_budget({"memory_size": 64 * gb}) == 48 * gb
    assert memory_budget({}) is None


def test_distributed_families_are_those_mlx_lm_can_shard():
    for family in DISTRIBUTED_FAMILIES:
        module = importlib.import_module(f"mlx_lm.models.{family}")
        assert hasattr(module.Model, "shard") or any(hasattr(c, "pipeline") for c in vars(module).values())
    assert not hasattr(importlib.import_module("mlx_lm.models.gemma4").Model, "shard")
    pairs, _ = listing(16 * 10**9)
    fits = {row[0]: row[-1] for row in pairs}
    assert fits["Qwen/Qwen3.5-35B-A3B"] == "4-bit on 2 Macs"
    assert fits["google/gemma-4-31B-it"] == "no"  # gemma4: neither shard() nor pipeline() in mlx-lm


def test_models_shows_sizes_fit_and_the_targets_that_cannot_run():
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    row = next(line for line in lines if line.startswith("Qwen/Qwen3.5-27B "))
    assert row.split()[2:8] == ["thinking", "16", "54", "29", "15", row.split()[-1]]
    assert row.split()[-1] in ("bf16", "8-bit", "4-bit", "no")
    for target, draft in UNSUPPORTED_PAIRS.items():
        line = next(line for line in lines if line.startswith(target))
        assert draft.repo in line and draft.unsupported in line


def test_models_lists_the_dspark_drafts_with_sizes_and_fit():
    output = CliRunner().invoke(app, ["models"]).output
    assert all(d.repo in output for d in DSPARK_DRAFTS.values())
    pairs, _ = listing(16 * 10**9)
    row = next(r for r in pairs if r[1] == "deepseek-ai/dspark_qwen3_8b_block7")
    assert row == ["Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7", "template default", "7", "16", "9", "5",
                   "8-bit"]
