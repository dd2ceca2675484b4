"""The README's headline figures are the figures of the run stored in docs/bench-demo.json."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = json.loads((ROOT / "docs" / "bench-demo.json").read_text())
ARMS = {"auto": "adaptive block", "16": "block 16", "8": "block 8"}


def rows(text, first_cell):
    """Cells of each markdown table row of ``text`` whose first cell starts with ``first_cell``."""
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            found[cells[0]] = cells
    return found


def arguments(command):
    """The bench arguments of a command, without where it wrote its files."""
    return re.split(r"\s--json\s", command)[0].split()


def test_the_readme_quotes_the_stored_run_command():
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"one run of `(dflash-mlx bench [^`]+)`", readme)
    assert quoted, "README.md does not name the command of its demo rows"
    assert arguments(quoted.group(1)) == arguments(RUN["command"])[: len(arguments(quoted.group(1)))]
    assert arguments(RUN["command"])[len(arguments(quoted.group(1))) :] in ([], ["--repeat", "1"])


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_the_readme_demo_rows_are_the_stored_run(arm):
    summary = RUN["summary"]["dflash"][arm]
    row = rows((ROOT / "README.md").read_text(), "demo pair")[f"demo pair, {ARMS[arm]}"]
    assert row[2] == f"{summary['tau']:.2f}"
    assert row[3].startswith(f"{summary['speedup']['median']:.2f}x (median; {summary['speedup_total']:.2f}x in total)")
    assert summary["identical"] == summary["compared"]


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_the_benchmarks_table_is_the_stored_run(arm):
    text = (ROOT / "docs/benchmarks.md").read_text()
    section = text[text.index("## Results on the demo pair (CPU)") :]
    label = "DFlash auto" if arm == "auto" else f"DFlash b={arm}"
    row = rows(section[: section.index("\n\n", section.index("| arm |"))], label)[label]
    summary = RUN["summary"]["dflash"][arm]
    speedup = summary["speedup"]
    assert row[2] == (
        f"{speedup['median']:.2f}x [{speedup['q1']:.2f}-{speedup['q3']:.2f}] ({speedup['min']:.2f}-{speedup['max']:.2f})"
    )
    assert row[3:6] == [f"{summary['speedup_total']:.2f}x", f"{summary['tau']:.2f}", f"{summary['identical']}/{summary['compared']}"]
    assert row[1] == f"{summary['decode_tps']['median']:.1f}"
