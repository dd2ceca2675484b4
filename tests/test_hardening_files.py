"""Commands that write files write only where they should: draft-vocab never
into the installed package nor beside a draft of another target nor over a
file it did not write, and bad destinations end in one error line."""

import hashlib
import shutil
from pathlib import Path

import pytest

from dflash_mlx.demo import DEMO_DIR
from dflash_mlx.draft import RANKING_FILE
from dflash_mlx.errors import DFlashError
from cli_run import cli, one_error_line




def digest(folder: Path) -> dict:
    """Every file under ``folder`` (hidden ones too) by content."""
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 10)
    return path


def test_draft_vocab_leaves_the_bundled_demo_ranking_alone(corpus):
    before = digest(DEMO_DIR / "draft")
    one_error_line(cli("draft-vocab", corpus), "is part of the installed dflash-mlx")
    assert digest(DEMO_DIR / "draft") == before


def test_draft_vocab_writes_only_beside_a_draft_of_the_target(tmp_path, corpus, target_dirs, draft_dir):
    target = target_dirs["qwen3"]
    other = tmp_path / "other-draft"  # made for a 4-layer target, not this 6-layer one
    shutil.copytree(draft_dir("qwen3_moe"), other)
    a_target = tmp_path / "a-target"
    shutil.copytree(target_dirs["llama"], a_target)
    for folder, wanted in [(other, "does not match the target's"), (a_target, "draft config.json")]:
        before = digest(folder)
        one_error_line(cli("draft-vocab", "-m", target, "-d", folder, corpus), wanted)
        assert digest(folder) == before


def test_draft_vocab_replaces_no_other_file(tmp_path, corpus, target_dirs, draft_dir):
    target, draft = target_dirs["qwen3"], tmp_path / "draft"
    shutil.copytree(draft_dir("qwen3"), draft)
    (draft / RANKING_FILE).write_text("my notes")
    one_error_line(cli("draft-vocab", "-m", target, "-d", draft, corpus), "is not a ranking written by")
    assert (draft / RANKING_FILE).read_text() == "my notes"


def test_draft_vocab_into_an_odd_path_is_one_error_line(corpus, target_dirs):
    one_error_line(cli("draft-vocab", "-m", target_dirs["qwen3"], "-d", "/proc/self", corpus), "/proc/self")


def test_draft_vocab_needs_the_targets_tokenizer(tmp_path, corpus, target_dirs, draft_dir):
    from dflash_mlx.vocab_ranking import rank_for_draft

    bare, draft = tmp_path / "bare", tmp_path / "draft"
    shutil.copytree(target_dirs["qwen3"], bare)
    shutil.copytree(draft_dir("qwen3"), draft)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(DFlashError, match="has no tokenizer"):
        rank_for_draft([str(corpus)], str(bare), str(draft))
    assert not (draft / RANKING_FILE).exists()
