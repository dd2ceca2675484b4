"""JSON Lines files (bench prompt sets, training records): blank lines skipped,
every problem one line naming the file and line."""

import pytest

from dflash_mlx import DFlashError
from dflash_mlx.bench.prompts import load_prompts
from dflash_mlx.jsonl import read_jsonl
from dflash_mlx.train.records import read_records


def test_objects_with_their_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n\n  \n[2]\n', encoding="utf-8")
    assert list(read_jsonl(path)) == [(1, {"x": 1}), (4, [2])]


@pytest.mark.parametrize("data, message", [
    (b'{"prompt": "a"}\n{"prompt": \n', r"a\.jsonl:2: not valid JSON"),
    (b'{"prompt": "caf\xc3"}\n', r"a\.jsonl' is not valid UTF-8"),
])
@pytest.mark.parametrize("reader", [load_prompts, lambda p: read_records([str(p)])])
def test_bad_files_name_the_file_and_line(tmp_path, data, message, reader):
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    with pytest.raises(DFlashError, match=message):
        reader(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DFlashError, match="cannot read .*nope.jsonl"):
        list(read_jsonl(tmp_path / "nope.jsonl"))
