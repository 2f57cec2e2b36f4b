"""megahash/atomic_write.py: a reader sees the old file or the new one, and a failed writer leaves
the old file and no temp file behind."""

import json

import pytest

from megahash.atomic_write import atomic_path, write_bytes_atomic, write_json_atomic, write_text_atomic


def test_writes_replace_whole_files_and_leave_no_temp(tmp_path):
    p = tmp_path / "sub" / "f.json"
    write_text_atomic(p, "old")
    assert p.read_text() == "old"
    write_json_atomic(p, {"a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2]}
    write_bytes_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.json"]


def test_a_failed_writer_keeps_the_old_file(tmp_path):
    p = tmp_path / "f.txt"
    write_text_atomic(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["f.txt"]
