"""kvtool.files: the one atomic writer every output file goes through, and the early writability probe."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

import pytest

from kvtool.errors import KvtoolError
from kvtool.files import check_writable, write_atomic, write_text_atomic


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writes_text_creating_parent_dirs(tmp_path: Path) -> None:
    dest = tmp_path / "a" / "b" / "out.json"
    assert write_text_atomic(dest, "{}\n", "JSON") == dest
    assert dest.read_text(encoding="utf-8") == "{}\n"
    assert files_in(dest.parent) == ["out.json"]  # no temp file left beside it
    # tempfile creates 0600 files; an output file should be readable like any other.
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644


def test_overwrite_keeps_permissions(tmp_path: Path) -> None:
    dest = tmp_path / "out.txt"
    dest.write_text("old")
    dest.chmod(0o600)
    write_text_atomic(str(dest), "new ✓")
    assert dest.read_text(encoding="utf-8") == "new ✓"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failing_writer_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, error: BaseException) -> None:
    dest = tmp_path / "out.txt"
    dest.write_text("good")

    def write(stream: IO[str]) -> None:
        stream.write("half")
        raise error

    with pytest.raises(type(error)):
        write_atomic(dest, write)
    assert dest.read_text() == "good"
    assert files_in(tmp_path) == ["out.txt"]


def test_failed_rename_is_a_one_line_error_naming_what(tmp_path: Path, monkeypatch) -> None:
    dest = tmp_path / "out.json"
    dest.write_text("good")

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(KvtoolError) as info:
        write_text_atomic(dest, "new", "JSON")
    assert str(info.value) == f"cannot write JSON to {dest}: No space left on device"
    assert dest.read_text() == "good"
    assert files_in(tmp_path) == ["out.json"]


def test_parent_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(KvtoolError, match="cannot write plot to .*not-a-dir/p.png"):
        write_text_atomic(blocker / "p.png", "x", "plot")


def test_check_writable_probes_without_leaving_anything(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "p.yaml"
    assert check_writable(target) == target
    assert files_in(tmp_path) == []


def test_check_writable_refuses_directories_and_file_parents(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(KvtoolError, match=r"cannot write JSON to .*: it is a directory"):
        check_writable(tmp_path, "JSON")
    with pytest.raises(KvtoolError, match=r"cannot write profile to .*: .*file is not a directory"):
        check_writable(blocker / "sub" / "p.yaml")
    assert files_in(tmp_path) == ["file"]
