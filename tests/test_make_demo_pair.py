"""examples/make_demo_pair.py carries training across sessions through a
committed snapshot: what it copies and how a fresh work directory starts from it."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "make_demo_pair.py"


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_demo_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "SNAPSHOT", tmp_path / "snapshot")
    return module


def fake_checkpoint(stage_dir: Path, step: int) -> Path:
    path = stage_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step}))
    (path / "model.safetensors").write_bytes(bytes([step % 256]) * 16)
    return path


def fake_output(path: Path, tag: str) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tag": tag}))


def test_unfinished_stage_resumes_from_its_newest_checkpoint(pipeline, tmp_path):
    old = tmp_path / "old" / "target_extended"
    fake_checkpoint(old, 20)
    fake_checkpoint(old, 40)
    pipeline.take_snapshot(tmp_path / "old")

    fresh = tmp_path / "fresh" / "target_extended"
    pipeline.resume_from_snapshot(fresh)
    got = pipeline.list_checkpoints(fresh)
    assert [p.name for p in got] == ["step_00000040"]
    assert (got[0] / "model.safetensors").read_bytes() == bytes([40]) * 16

    own = tmp_path / "own" / "target_extended"
    fake_checkpoint(own, 60)
    pipeline.resume_from_snapshot(own)  # has its own: left alone
    assert [p.name for p in pipeline.list_checkpoints(own)] == ["step_00000060"]


def test_finished_stage_carries_its_output_and_is_not_retrained(pipeline, tmp_path):
    old = tmp_path / "old"
    fake_checkpoint(old / "target_extended", 2980)
    fake_output(old / "target_extended" / "final", "extended")
    fake_checkpoint(old / "draft", 100)
    pipeline.take_snapshot(old)

    snap = pipeline.SNAPSHOT
    assert not (snap / "target_extended" / "checkpoints").exists()  # the output replaces them
    assert [p.name for p in pipeline.list_checkpoints(snap / "draft")] == ["step_00000100"]

    fresh = tmp_path / "fresh"
    # without its output the stage would load work/target/final and train: there is none here
    assert pipeline.stage_extend(fresh) == fresh / "target_extended" / "final"
    assert json.loads((fresh / "target_extended" / "final" / "config.json").read_text()) == {"tag": "extended"}
    assert pipeline.list_checkpoints(fresh / "target_extended") == []


def test_the_dflash2_draft_is_the_candidate_only_once_compare_found_it_better(pipeline, tmp_path):
    work = tmp_path / "work"
    fake_output(work / "target_extended" / "final", "extended")
    fake_output(work / "draft" / "draft", "v1")
    v1_pair = (work / "target_extended" / "final", work / "draft" / "draft")
    assert pipeline.candidate_pair(work) == v1_pair
    (work / "compare.json").write_text(json.dumps({"winner": "v2"}))
    assert pipeline.candidate_pair(work) == v1_pair  # the DFlash2 draft is not finished
    fake_output(work / "draft2" / "draft", "v2")
    assert pipeline.candidate_pair(work) == (work / "target" / "final", work / "draft2" / "draft")
    (work / "compare.json").write_text(json.dumps({"winner": "v1"}))
    assert pipeline.candidate_pair(work) == v1_pair


def test_compare_reads_an_unfinished_draft_from_its_newest_checkpoint(pipeline, tmp_path):
    run = tmp_path / "work" / "draft2"
    fake_checkpoint(run, 25)
    fake_checkpoint(run, 50)
    (run / "train_config.json").write_text(json.dumps({"draft": {"architectures": ["DFlash2DraftModel"]}}))
    probe = pipeline.newest_draft(run)
    assert json.loads((probe / "config.json").read_text()) == {"architectures": ["DFlash2DraftModel"]}
    assert (probe / "model.safetensors").read_bytes() == bytes([50]) * 16
    fake_output(run / "draft", "finished")
    assert pipeline.newest_draft(run) == run / "draft"


def test_the_target_stage_starts_from_the_target_the_package_ships(pipeline, tmp_path):
    """The script and dflash_mlx.demo name the same folder for the shipped
    target (demo_pair/target_model/: a folder named target/ is ignored by
    common .gitignore templates, so a rebuilt pair's files would go uncommitted)."""
    from dflash_mlx import DFlashError
    from dflash_mlx.demo import demo_pair

    try:
        shipped = demo_pair().target
    except DFlashError:
        pytest.skip("the bundled demo pair is not in this checkout")
    assert shipped.name != "target"
    final = pipeline.stage_target(tmp_path / "work")
    assert final == tmp_path / "work" / "target" / "final"
    assert (final / "config.json").read_text() == (shipped / "config.json").read_text()
    copied = sorted(p.name for p in final.iterdir() if not p.name.startswith("."))  # less staged_output's marker
    assert copied == sorted(p.name for p in shipped.iterdir())
