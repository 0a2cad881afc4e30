"""Run the kvtool entry point in-process, as a user's shell would (exit code, stdout, stderr)."""

from __future__ import annotations

import sys

from kvtool.cli.app import main


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kvtool", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
