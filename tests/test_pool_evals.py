"""benchmarks/pool_evals.py: eval files over different prompts pooled into one set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def pool_evals():
    return load_benchmark("pool_evals")


def result(method, nll, tokens, rouge, accuracy=None, budget=0.2):
    return {"method": method, "budget": budget, "nll_per_prompt": nll, "tokens_per_prompt": tokens,
            "rouge_l_per_prompt": rouge, "accuracy_per_prompt": accuracy}


def write(path: Path, full_ppl, reference_tokens, results, full_accuracy=None) -> str:
    path.write_text(json.dumps({"full_ppl": full_ppl, "reference_tokens": reference_tokens, "full_accuracy": full_accuracy, "results": results}))
    return str(path)


def test_sets_pool_over_tokens_and_pair_over_prompts(pool_evals, tmp_path, capsys):
    short = write(tmp_path / "short.json", 2.0, 30, [
        result("a", [3.0, 6.0], [10, 20], [0.5, 0.7], [1.0, None]),
        result("b", [4.0, 8.0], [10, 20], [0.4, 0.9], [0.0, None]),
        result("b", [0.0, 0.0], [10, 20], [0.0, 0.0], budget=0.1),
    ], full_accuracy=0.5)
    long_old = write(tmp_path / "long-old.json", 1.5, 40, [result("a", [9.0], [40], [0.1]), result("b", [10.0], [40], [0.1])])
    long_new = write(tmp_path / "long-new.json", 1.5, 40, [result("a", [8.0], [40], [0.3]), result("c", [1.0], [40], [0.3])])
    sets = [pool_evals.read_set(short, 0.2), pool_evals.read_set(f"{long_old}+{long_new}", 0.2)]
    full, needles, methods = pool_evals.pool(sets)
    assert full == pytest.approx(math.exp((30 * math.log(2.0) + 40 * math.log(1.5)) / 70))
    assert needles == 0.5
    assert list(methods) == ["a", "b"]  # c is not in every set; the later file's a replaced the earlier one's
    a, b = methods["a"], methods["b"]
    assert a.ppl == pytest.approx(math.exp((3 + 6 + 8) / 70)) and b.ppl == pytest.approx(math.exp((4 + 8 + 10) / 70))
    assert a.rouge == [0.5, 0.7, 0.3] and pool_evals.needles(a) == 1.0 and pool_evals.needles(b) == 0.0
    text = pool_evals.table(full, needles, methods, "a")
    rouge = [0.1, -0.2, 0.2]
    nll = [0.3 - 0.4, 0.3 - 0.4, 0.2 - 0.25]
    mean, err = sum(rouge) / 3, (sum((r - sum(rouge) / 3) ** 2 for r in rouge) / 2) ** 0.5 / 3 ** 0.5
    assert f"| b | {(a.ppl - b.ppl) / full:+.3f} | {mean:+.3f} ± {err:.3f} | 2 / 1 | {sum(nll) / 3:+.4f}" in text
    assert "3 prompts; full cache PPL" in text and "| a | " in text
    with pytest.raises(SystemExit, match="no method 'z'"):
        pool_evals.table(full, needles, methods, "z")


def test_bad_files_are_one_line_errors(pool_evals, tmp_path):
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(SystemExit, match="is not JSON"):
        pool_evals.read_set(str(tmp_path / "x.json"), 0.2)
    (tmp_path / "y.json").write_text("[]")
    with pytest.raises(SystemExit, match="not a kvtool eval --json file"):
        pool_evals.read_set(str(tmp_path / "y.json"), 0.2)
    with pytest.raises(SystemExit, match="cannot read"):
        pool_evals.read_set(str(tmp_path / "missing.json"), 0.2)
