"""benchmarks/unseen_calibration.py: the calibration prompts a calibration run leaves out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kvtool.data import load_jsonl, select_by_kind

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "unseen_calibration.py"


def load_script():
    spec = importlib.util.spec_from_file_location("unseen_calibration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_prompts_are_exactly_those_no_listed_draw_uses(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "unseen.jsonl"
    script.main(["--samples", "10", "--samples", "20", "--out", str(out)])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    records = load_jsonl(None)
    drawn = [r.prompt for n in (10, 20) for r in select_by_kind(records, n, 0)]
    assert len(written) == len(records) - len(set(drawn)) > 0
    assert not {row["prompt"] for row in written} & set(drawn)
    assert "wrote" in capsys.readouterr().out
