"""distill.atomic and distill.fingerprint: the one atomic-write helper and the one fingerprint diff."""

import hashlib
import os

import pytest

from distill.atomic import write_dir_atomically, write_file_atomically, write_text_atomically
from distill.fingerprint import Difference, differences, file_digest, json_digest, tree_digests


def test_a_failed_file_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = write_text_atomically(tmp_path / "a.json", "old")

    def half(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomically(path, half)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failed_dir_write_leaves_the_old_dir_and_replace_false_keeps_the_first(tmp_path):
    def fill(text):
        return lambda tmp: (tmp / "f.txt").write_text(text)

    def half(tmp):
        fill("half")(tmp)
        raise RuntimeError("killed")

    path = write_dir_atomically(tmp_path / "d", fill("first"))
    with pytest.raises(RuntimeError, match="killed"):
        write_dir_atomically(path, half)
    assert (path / "f.txt").read_text() == "first"
    write_dir_atomically(path, fill("second"), replace=False)  # another process finished first: keep theirs
    assert (path / "f.txt").read_text() == "first"
    write_dir_atomically(path, fill("third"))
    assert (path / "f.txt").read_text() == "third" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777, (path / "f.txt").stat().st_mode & 0o777) == (0o777 & ~umask, 0o666 & ~umask)


def test_digests_match_hashlib_and_ignore_key_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"x" * (3 << 20))  # more than one read block
    (tmp_path / "a.txt").write_text("a")
    assert file_digest(tmp_path / "sub" / "b.bin") == hashlib.sha256(b"x" * (3 << 20)).hexdigest()
    assert list(tree_digests(tmp_path)) == ["a.txt", "sub/b.bin"]
    assert json_digest({"a": 1, "b": [2]}) == json_digest({"b": [2], "a": 1}) != json_digest({"a": 1, "b": [3]})


def test_differences_go_one_level_into_dicts_in_name_order():
    stored = {"data": {"max_length": 64, "source": "stdlib"}, "topk": 8, "same": 1, "gone": 2}
    current = {"data": {"max_length": 128, "source": "stdlib", "new": True}, "topk": 16, "same": 1}
    assert differences(stored, current, ["topk", "data", "same", "gone"]) == [
        Difference("topk", None, 8, 16),
        Difference("data", "max_length", 64, 128),
        Difference("data", "new", None, True),
        Difference("gone", None, 2, None),
    ]
