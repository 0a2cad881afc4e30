"""benchmarks/compare.py: kvtool eval and kvpress results side by side, paired per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare")


def write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def kvtool_doc() -> dict:
    kinds = ["chat", "chat", "retrieval", "retrieval"]
    return {
        "full_ppl": 1.5, "full_accuracy": 1.0, "full_kinds": {"chat": {"ppl": 1.4}, "retrieval": {"ppl": 1.6}},
        "kinds_per_prompt": kinds,
        "results": [
            {"method": "kvtool", "budget": 0.2, "ppl": 1.7, "rouge_l_per_prompt": [0.9, 0.7, 0.5, 0.3],
             "accuracy_per_prompt": [None, None, 1.0, 0.5], "kv_fraction": 0.2,
             "kinds": {"chat": {"ppl": 1.6}, "retrieval": {"ppl": 1.8}}},
            {"method": "h2o", "budget": 0.2, "ppl": 2.0, "rouge_l_per_prompt": [0.8, 0.7, 0.2, 0.4],
             "accuracy_per_prompt": [None, None, 0.0, 0.5], "kv_fraction": 0.2, "kinds": {}},
            {"method": "h2o", "budget": 0.5, "ppl": 1.6, "rouge_l_per_prompt": [1, 1, 1, 1],
             "accuracy_per_prompt": [None, None, 1.0, 1.0], "kv_fraction": 0.5, "kinds": {}},
        ],
    }


def test_tables_pair_every_row_with_the_chosen_method(compare, tmp_path, capsys):
    evals = write(tmp_path / "e.json", kvtool_doc())
    peer = write(tmp_path / "p.json", {"results": [
        {"method": "tova", "budget": 0.2, "prompt_only": True, "ppl": 1.9, "rouge_l_per_prompt": [0.9, 0.9, 0.1, 0.1],
         "accuracy_per_prompt": [None, None, 0.0, 0.0], "kv_fraction": 0.3, "kinds": {}},
        {"method": "none", "budget": 0.2, "prompt_only": True, "ppl": 1.5, "rouge_l_per_prompt": [1, 1, 1, 1],
         "accuracy_per_prompt": [None, None, 1.0, 1.0], "kv_fraction": 1.0, "kinds": {}},
    ]})
    compare.main([str(evals), "--peer", str(peer), "--budget", "0.2", "--against", "kvtool"])
    out = capsys.readouterr().out
    assert "| kvpress tova | prompt only | 1.900 |" in out
    assert "| kvtool | prompt + generation (budget held) | 1.700 | 0.600 ± 0.129 | 0.750 | 20.0% | - |" in out
    assert "kvpress none" not in out and "1.600" not in out.split("| kvtool |")[0]  # other budget left out
    # kvtool minus h2o: diffs 0.1, 0, 0.3, -0.1 -> mean 0.075; ahead on 2, behind on 1.
    assert "| h2o | +0.075 ± 0.085 | 2 / 1 |" in out
    # Per kind: chat diffs 0.1, 0 -> +0.050; retrieval accuracy diffs 1.0, 0 -> +0.500.
    assert "+0.050 ± 0.050" in out and "+0.500 ± 0.500" in out


def test_mismatched_files_are_refused(compare, tmp_path):
    doc = kvtool_doc()
    peer = write(tmp_path / "p.json", {"results": [
        {"method": "tova", "budget": 0.2, "prompt_only": True, "ppl": 1.9, "rouge_l_per_prompt": [0.9],
         "accuracy_per_prompt": [None], "kv_fraction": 0.3, "kinds": {}},
    ]})
    with pytest.raises(SystemExit, match="different numbers of prompts"):
        compare.main([str(write(tmp_path / "e.json", doc)), "--peer", str(peer), "--budget", "0.2"])
    with pytest.raises(SystemExit, match="no results at budget 0.3"):
        compare.main([str(tmp_path / "e.json"), "--budget", "0.3"])


def test_unreadable_files_are_one_line_errors(compare, tmp_path):
    with pytest.raises(SystemExit, match=r"cannot read .*missing.json: No such file"):
        compare.main([str(tmp_path / "missing.json"), "--budget", "0.2"])
    (tmp_path / "cut.json").write_text('{"results": [')
    with pytest.raises(SystemExit, match=r"cut.json is not JSON"):
        compare.main([str(tmp_path / "cut.json"), "--budget", "0.2"])
    with pytest.raises(SystemExit, match=r'other.json has no "results" list'):
        compare.main([str(write(tmp_path / "e.json", kvtool_doc())), "--peer", str(write(tmp_path / "other.json", [1])), "--budget", "0.2"])


def test_plot_draws_every_budget_of_the_files(compare, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    evals = write(tmp_path / "e.json", kvtool_doc())
    out = tmp_path / "plots" / "quality.png"
    compare.main([str(evals), "--plot", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(out.parent.glob("*.tmp.png"))
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare.main([str(evals)])  # neither a budget nor a plot


def test_labelled_files_sit_side_by_side_with_paired_nll(compare, tmp_path, capsys):
    first, second = kvtool_doc(), kvtool_doc()
    first["results"][0].update(nll_per_prompt=[2.0, 3.0, 1.0, 4.0], tokens_per_prompt=[4, 3, 1, 0])
    second["results"][0].update(nll_per_prompt=[1.0, 3.0, 2.0, 4.0], tokens_per_prompt=[4, 3, 1, 0], ppl=1.65)
    a, b = write(tmp_path / "a.json", first), write(tmp_path / "b.json", second)
    compare.main([f"{a}:ten", f"{b}:twenty", "--budget", "0.2", "--against", "kvtool [twenty]"])
    out = capsys.readouterr().out
    assert "| kvtool [ten] | prompt + generation (budget held) | 1.700 |" in out
    assert "| kvtool [twenty] | prompt + generation (budget held) | 1.650 |" in out
    # Per token: twenty 0.25, 1, 2 vs ten 0.5, 1, 1 (the prompt without tokens is left out):
    # differences -0.25, 0, +1 -> mean +0.25, lower on one prompt.
    assert "+0.2500 ± 0.3819 (lower on 1)" in out.split("| kvtool [ten] |")[-1]
    # Files without per-prompt NLL show no NLL difference; a path with no label reads as a path.
    assert "| h2o [ten] |" in out and out.rstrip().endswith("| - |")
    assert compare.labelled("docs/x.json") == (Path("docs/x.json"), None)
    assert compare.labelled("C:/x.json") == (Path("C:/x.json"), None)


def test_rows_show_their_peak(compare, tmp_path, capsys):
    doc = kvtool_doc()
    doc["results"][0].update(kv_peak_fraction=0.97)
    doc["results"][1].update(kv_peak_fraction=0.21)
    compare.main([str(write(tmp_path / "e.json", doc)), "--budget", "0.2", "--against", "kvtool"])
    out = capsys.readouterr().out
    assert "| kvtool | prompt + generation (budget held) | 1.700 |" in out
    assert "| 0.750 | 20.0% | 97.0% |" in out
    assert "| h2o | prompt + generation (budget held) | 2.000 |" in out and "| 20.0% | 21.0% |" in out


def test_draft_rows_say_so(compare, tmp_path, capsys):
    doc = kvtool_doc()
    doc["results"][0].update(kv_peak_fraction=0.21, draft=24)
    compare.main([str(write(tmp_path / "e.json", doc)), "--budget", "0.2", "--against", "kvtool"])
    out = capsys.readouterr().out
    assert "| kvtool | prompt + generation (budget held; prompt compressed with the attention of a 24-token draft) | 1.700 |" in out


def test_nll_by_answer_position_is_paired_per_bucket(compare, tmp_path, capsys):
    doc = kvtool_doc()
    labels = {"1-32": 1.0, "33-128": 1.0, "129+": None}
    doc["results"][0].update(ppl_by_position=labels, nll_by_position_per_prompt=[[2.0, 6.0, 0.0]] * 2 + [[1.0, 0.0, 0.0]] * 2,
                             tokens_by_position_per_prompt=[[4, 6, 0]] * 2 + [[2, 0, 0]] * 2)
    doc["results"][1].update(ppl_by_position=labels, nll_by_position_per_prompt=[[4.0, 3.0, 0.0], [2.0, 9.0, 0.0]] + [[1.0, 0.0, 0.0]] * 2,
                             tokens_by_position_per_prompt=[[4, 6, 0]] * 2 + [[2, 0, 0]] * 2)
    compare.main([str(write(tmp_path / "e.json", doc)), "--budget", "0.2", "--against", "kvtool"])
    out = capsys.readouterr().out
    row = out.split("| kvtool minus, NLL per token |")[1].split("| h2o |")[1]
    # Tokens 1-32: kvtool 0.5, 0.5, 0.5, 0.5 against h2o 1, 0.5, 0.5, 0.5. Tokens 33-128 (two prompts
    # reach it): kvtool 1, 1 against h2o 0.5, 1.5. Nothing reaches 129.
    assert "-0.1250 ± 0.1250 (lower on 1 of 4)" in row
    assert "+0.0000 ± 0.5000 (lower on 1 of 2)" in row and row.rstrip().endswith("| - |")
    assert compare.position_nll({"method": "x"}) is None
