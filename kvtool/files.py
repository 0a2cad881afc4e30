"""Writing output files safely: the one atomic writer and the early writability probe.

Every file kvtool writes (profiles, eval JSON) goes through `write_atomic`, so a crash or a full
disk never leaves half a file where a good one was. Standard library only: any layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from kvtool.errors import KvtoolError

# Files created by kvtool get ordinary permissions, not tempfile's private 0600.
NEW_FILE_MODE = 0o644


def write_atomic(
    path: str | os.PathLike[str], write: Callable[[IO], None], what: str = "file", *, binary: bool = False
) -> Path:
    """Create or replace `path` with what `write(stream)` writes (UTF-8 text, or bytes when `binary`);
    parent dirs are created.

    The text goes to a temp file in the same directory that is renamed over `path` only once
    complete, so readers never see a partial file and an existing one survives any failure. An
    OSError becomes a one-line KvtoolError naming `what` and the path; anything `write` raises
    propagates unchanged after the temp file is removed.
    """
    dest = Path(path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(
            "wb" if binary else "w", encoding=None if binary else "utf-8",
            dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp", delete=False,
        )
    except OSError as exc:
        raise _write_error(dest, what, exc) from exc
    try:
        with tmp:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp.name, _mode_for(dest))
        os.replace(tmp.name, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        if isinstance(exc, OSError):
            raise _write_error(dest, what, exc) from exc
        raise
    _fsync_dir(dest.parent)
    return dest


def write_text_atomic(path: str | os.PathLike[str], text: str, what: str = "file") -> Path:
    """`write_atomic` for text already in memory."""
    return write_atomic(path, lambda stream: stream.write(text), what)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, what: str = "file") -> Path:
    """`write_atomic` for bytes already in memory."""
    return write_atomic(path, lambda stream: stream.write(data), what, binary=True)


def check_writable(path: str | Path, what: str = "profile") -> Path:
    """Fail before any model work if `path` cannot be written; leaves nothing behind.

    Probes with a real temporary file (permission bits say nothing when running as root, and
    read-only mounts only show on write) in the nearest directory that exists.
    """
    dest = Path(path)
    if dest.is_dir():
        raise KvtoolError(f"cannot write {what} to {dest}: it is a directory")
    parent = dest.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise KvtoolError(f"cannot write {what} to {dest}: {parent} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kvtool-probe-", delete=True):
            pass
    except OSError as exc:
        raise KvtoolError(f"cannot write {what} to {dest}: {exc.strerror or exc}") from None
    return dest


def _mode_for(dest: Path) -> int:
    # Overwriting keeps the existing file's permissions.
    try:
        return stat.S_IMODE(dest.stat().st_mode)
    except OSError:
        return NEW_FILE_MODE


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not worth failing over.
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_error(dest: Path, what: str, exc: OSError) -> KvtoolError:
    return KvtoolError(f"cannot write {what} to {dest}: {exc.strerror or exc}")
