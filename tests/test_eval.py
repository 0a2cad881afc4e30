"""`kvtool eval`: the PPL protocol against a hand computation, ROUGE-L wiring, the JSON contract,
and bad input."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.data import load_jsonl
from kvtool.evaluation import EvalConfig, evaluate
from kvtool.evaluation.metrics import rouge_l_f1
from kvtool.models import load_model
from kvtool.scoring import encode_prompt
from cli_runner import run

WORDS = "the cat dog sat on mat and it ran away to house big small red blue green one two three".split()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None




def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    rng = random.Random(11)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60)))} for _ in range(5)]
    return _write(tmp_path_factory.mktemp("eval") / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def answers_file(tmp_path_factory) -> Path:
    rng = random.Random(12)
    rows = [
        {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60))),
         "answer": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))}
        for _ in range(4)
    ]
    return _write(tmp_path_factory.mktemp("eval") / "answers.jsonl", rows)


def test_rouge_l_hand_computed():
    assert rouge_l_f1("the cat sat", "the cat sat") == 1.0
    # LCS("the cat sat on the mat", "the cat on mat") = 4 tokens: P = 4/6, R = 4/4, F = 0.8.
    assert rouge_l_f1("the cat sat on the mat", "the cat on mat") == pytest.approx(0.8)
    assert rouge_l_f1("dog", "cat") == 0.0
    assert rouge_l_f1("", "") == 1.0


def test_rouge_l_standard_error_hand_computed():
    from kvtool.evaluation.results import MethodResult

    three = MethodResult("h2o", 0.2, 3.0, 0.4, 0.2, 10, rouge_l_per_prompt=(0.2, 0.4, 0.6))
    assert three.rouge_l_sem == pytest.approx(0.2 / math.sqrt(3))  # sample sd 0.2 over 3 prompts
    assert math.isnan(MethodResult("h2o", 0.2, 3.0, 0.4, 0.2, 10, rouge_l_per_prompt=(0.4,)).rouge_l_sem)


def test_budget_one_ppl_equals_a_plain_forward(loaded, answers_file):
    """Budget 1.0 teacher-forced token by token through kvtool's cache, in padded batches, gives the
    PPL of one plain forward over prompt + answer per sample, computed here by hand."""
    records = load_jsonl(answers_file)
    report = evaluate(loaded, data=records, config=EvalConfig(methods=("elastic",), budgets=(1.0,), max_new_tokens=4, batch_size=3))
    total, count = 0.0, 0
    with torch.no_grad():
        for record in records:
            prompt = encode_prompt(loaded.tokenizer, record.prompt, 1024)
            answer = loaded.tokenizer(record.answer, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer])
            logp = torch.log_softmax(loaded.model(input_ids=ids).logits[0].double(), dim=-1)
            for i, token in enumerate(answer):
                total -= float(logp[len(prompt) - 1 + i, token])
                count += 1
    expected = math.exp(total / count)
    assert report.reference_tokens == count
    assert report.references == "answers"
    assert report.full_ppl == pytest.approx(expected, rel=1e-5)
    (result,) = report.results
    assert result.ppl == pytest.approx(expected, rel=1e-5)
    assert result.rouge_l == 1.0  # same greedy output as the full cache
    # At budget 1.0 every layer keeps each batch's whole padded prompt (width W) and grows by one
    # 16-slot block (GROWTH_SLOTS) for the first new token (the longest row has no padding slot to
    # fill); the 3 greedy tokens fed (the 4th is never fed; no row of this seeded model stops at
    # EOS sooner) fit in it. Each slot holds the key and value (2 * kv heads * head dim float32)
    # plus 10 bytes of bookkeeping: valid (bool), order (int64), frozen (bool). A full cache holds
    # W + 3 positions of key and value. Same for every layer, so per batch of B rows: kept
    # B (W + 16) (kv + 10) against full B (W + 3) kv (about 1.3 here).
    config = loaded.model.config
    kv = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    lengths = sorted(len(encode_prompt(loaded.tokenizer, r.prompt, 1024)) for r in records)
    batches = [lengths[i : i + 3] for i in range(0, len(lengths), 3)]  # make_batches: by length, 3 per batch
    kept = sum(len(b) * (max(b) + 16) * (kv + 10) for b in batches)
    full = sum(len(b) * (max(b) + 3) * kv for b in batches)
    assert result.kv_fraction == pytest.approx(kept / full, rel=1e-12)


def test_compressed_methods_cost_quality_and_save_memory(loaded, prompts_file):
    records = load_jsonl(prompts_file)
    report = evaluate(loaded, data=records, config=EvalConfig(methods=("local", "h2o", "elastic"), budgets=(0.2, 1.0), max_new_tokens=6))
    by = {(r.method, r.budget): r for r in report.results}
    assert report.references == "full-cache greedy"
    for method in ("local", "h2o", "elastic"):
        assert by[(method, 0.2)].kv_fraction < 0.6  # 16-slot growth floor on ~50-token prompts
        assert by[(method, 1.0)].ppl == pytest.approx(report.full_ppl, rel=1e-5)
        assert by[(method, 1.0)].rouge_l == 1.0
        assert by[(method, 1.0)].agreement == 1.0
        # Greedy decoding through the compressed cache leaves the full cache's text exactly at the
        # first reference token the teacher-forced pass does not rank first: a prompt whose every
        # token agrees is generated identically, and one generated differently has a miss.
        scores = by[(method, 0.2)].per_prompt
        for top1, tokens, rouge in zip(scores.top1, scores.tokens, scores.rouge_l):
            assert 0 <= top1 <= tokens
            assert (top1 == tokens) == (rouge == 1.0)
        assert by[(method, 0.2)].agreement == pytest.approx(sum(scores.top1) / sum(scores.tokens))
    assert report.reference_tokens > 0


def test_cli_json_contract_and_plot(tiny_llama_dir, prompts_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "res" / "eval.json"
    args = ["eval", str(tiny_llama_dir), "--data", str(prompts_file), "--budgets", "0.3,0.6",
            "--methods", "local,elastic", "--max-new-tokens", "4", "--json", str(out)]
    if HAS_MATPLOTLIB:
        args += ["--plot", str(tmp_path / "eval.png")]
    code, stdout, stderr = run(monkeypatch, capsys, *args)
    assert code == 0, stderr
    doc = json.loads(out.read_text())
    assert isinstance(doc["full_ppl"], float)
    assert [(r["method"], r["budget"]) for r in doc["results"]] == [("local", 0.3), ("elastic", 0.3), ("local", 0.6), ("elastic", 0.6)]
    for r in doc["results"]:
        assert {"method", "budget", "ppl", "rouge_l", "kv_fraction"} <= set(r)
        assert len(r["rouge_l_per_prompt"]) == doc["samples"]
        assert r["rouge_l"] == pytest.approx(sum(r["rouge_l_per_prompt"]) / doc["samples"])
    assert "PPL" in stdout and "ROUGE-L" in stdout and "elastic" in stdout
    if HAS_MATPLOTLIB:
        assert (tmp_path / "eval.png").stat().st_size > 0


def test_prefixkv_without_a_profile_calibrates_first_and_says_so(tiny_llama_dir, prompts_file, monkeypatch, capsys):
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--data", str(prompts_file),
                               "--budgets", "0.3", "--methods", "prefixkv", "--max-new-tokens", "3")
    assert code == 0, stderr
    assert "calibrating on the packaged calibration prompts" in stderr
    assert "calibrated now" in stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--data", "MISSING.jsonl"], "no such data file"),
        (["--data", "EMPTY"], "no prompts"),
        (["--methods", "local,quest"], "unknown method 'quest'"),
        (["--budgets", "0.2,1.5"], "outside (0, 1]"),
        (["--budgets", "0"], "outside (0, 1]"),
        (["--budgets", "half"], "not a number"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--score-from", "64"], "--score-from"),
        (["--profile", "MISSING.yaml"], "MISSING.yaml"),
        (["--kinds", "code,poems"], "no prompts of kind 'poems' (the data has: document, image, chat, code, retrieval, long-answer)"),
    ],
    ids=["missing-file", "empty-data", "unknown-method", "budget-high", "budget-zero", "budget-text", "new-tokens", "score-from",
         "profile", "unknown-kind"],
)
def test_bad_input_is_one_line(tiny_llama_dir, tmp_path, monkeypatch, capsys, args, fragment):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else str(tmp_path / a) if a.startswith("MISSING") else a for a in args]
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), *args)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], stderr
    assert "Traceback" not in stderr


def test_answer_accuracy_is_string_match_all():
    from kvtool.evaluation.metrics import answer_accuracy

    assert answer_accuracy("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert answer_accuracy("The number is 1234567.", ["1234567", "7654321"]) == 0.5
    assert answer_accuracy("APPLE pie", ["apple"]) == 1.0  # case does not matter
    assert answer_accuracy("", ["x"]) == 0.0


def test_accuracy_kinds_and_per_prompt_values_in_data_order(loaded, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """Per-prompt values sit at their prompt's index although batches group prompts by length,
    accuracy is scored on answer rows only, and every kind gets its own figures."""
    from kvtool.runtime.generate import generate

    rng = random.Random(5)
    # Lengths out of order, so length-sorted batches reorder the prompts.
    lengths = [60, 20, 45, 30, 55, 25]
    prompts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]
    rows = [{"prompt": p, "kind": "text" if i % 2 else "lookup"} for i, p in enumerate(prompts)]
    for row in rows[::2]:
        row["answers"] = ["cat", "zebra"]  # "zebra" is not in the tiny vocabulary: at most 0.5
    path = _write(tmp_path / "kinds.jsonl", rows)
    out = tmp_path / "eval.json"
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--data", str(path), "--budgets", "0.3,1",
                               "--methods", "local", "--max-new-tokens", "5", "--batch-size", "2", "--json", str(out))
    assert code == 0, stderr
    doc = json.loads(out.read_text())
    assert doc["kinds_per_prompt"] == [r["kind"] for r in rows]
    alone = [generate(loaded.model, loaded.tokenizer, [p], max_new_tokens=5).outputs[0].strip() for p in prompts]
    assert [o["text"] for o in doc["full_outputs"]] == alone
    for result in doc["results"]:
        per = result["accuracy_per_prompt"]
        assert [a is None for a in per] == ["answers" not in r for r in rows]
        assert all(a in (0.0, 0.5) for a in per if a is not None)
        assert result["accuracy"] == pytest.approx(sum(a for a in per if a is not None) / 3)
        assert set(result["kinds"]) == {"lookup", "text"}
        assert result["kinds"]["text"]["accuracy"] is None and result["kinds"]["lookup"]["samples"] == 3
        tokens, nll = result["tokens_per_prompt"], result["nll_per_prompt"]
        assert result["ppl"] == pytest.approx(math.exp(sum(nll) / sum(tokens)))
        assert result["agreement"] == pytest.approx(sum(result["top1_per_prompt"]) / sum(tokens))
        assert set(result["kinds"]["text"]) >= {"agreement", "ppl", "rouge_l"}
    at_one = next(r for r in doc["results"] if r["budget"] == 1.0)
    expected = [None if "answers" not in r else (0.5 if "cat" in o.lower() else 0.0) for r, o in zip(rows, alone)]
    assert at_one["accuracy_per_prompt"] == expected
    assert doc["full_accuracy"] == at_one["accuracy"]
    assert "accuracy" in stdout and "lookup (3)" in stdout


def test_query_aware_methods_run_through_eval(loaded, prompts_file):
    """tova (held budget) and snapkv (prompt-only) are named methods like the others: exact at
    budget 1.0; at 0.3 the prompt-only cache ends up holding more than the held one."""
    records = load_jsonl(prompts_file)
    report = evaluate(loaded, data=records, config=EvalConfig(methods=("tova", "snapkv"), budgets=(0.3, 1.0), max_new_tokens=12))
    by = {(r.method, r.budget): r for r in report.results}
    for method in ("tova", "snapkv"):
        assert by[(method, 1.0)].ppl == pytest.approx(report.full_ppl, rel=1e-5)
        assert by[(method, 1.0)].rouge_l == 1.0
    assert by[("tova", 0.3)].kv_fraction < by[("snapkv", 0.3)].kv_fraction < 1.0


def test_score_from_leaves_the_first_tokens_out(loaded, prompts_file):
    """PPL, top-1 and token counts from token K on are the whole run's minus its first K tokens
    (the K-token run of the same greedy references); accuracy still reads the whole output."""
    records = load_jsonl(prompts_file)

    def run_eval(new: int, start: int):
        config = EvalConfig(methods=("h2o",), budgets=(0.3,), max_new_tokens=new, score_from=start)
        return evaluate(loaded, data=records, config=config)

    whole, head, tail = run_eval(6, 0), run_eval(2, 0), run_eval(6, 2)
    assert tail.score_from == 2 and tail.to_dict()["score_from"] == 2
    for a, b, c in ((whole.full, head.full, tail.full), *((w.per_prompt, h.per_prompt, t.per_prompt)
                    for w, h, t in zip(whole.results, head.results, tail.results))):
        assert [x - y for x, y in zip(a.tokens, b.tokens)] == list(c.tokens)
        assert all(t > 0 for t in c.tokens)
        assert [x - y for x, y in zip(a.nll, b.nll)] == pytest.approx(list(c.nll), abs=1e-9)
        if a.top1:
            assert [x - y for x, y in zip(a.top1, b.top1)] == list(c.top1)
    # ROUGE-L compares the outputs from token 2 on: both texts are decoded from their third token.
    from kvtool.evaluation.runner import _texts
    from kvtool.scoring import References

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    refs = References(tokens=ids, scored=torch.tensor([[True] * 4, [True, True, True, False]]), nll_full=torch.zeros(2, 4))
    decode = lambda x: loaded.tokenizer.decode(x, skip_special_tokens=True).strip()  # noqa: E731
    assert _texts(loaded.tokenizer, refs, 2) == [decode([7, 8]), decode([11])]
    assert _texts(loaded.tokenizer, refs) == [decode([5, 6, 7, 8]), decode([9, 10, 11])]


def test_nll_by_answer_position_splits_each_prompt(loaded, prompts_file, monkeypatch, capsys, tiny_llama_dir):
    """Answer tokens 1-32 of a 40-token run are the whole of a 32-token run of the same greedy
    references; the buckets add up to each prompt's totals, and the pooled PPLs follow from them."""
    records = load_jsonl(prompts_file)

    def run_eval(new: int):
        return evaluate(loaded, data=records, config=EvalConfig(methods=("h2o",), budgets=(0.3,), max_new_tokens=new))

    long, head = run_eval(40), run_eval(32)
    for whole, first in ((long.full, head.full), (long.results[0].per_prompt, head.results[0].per_prompt)):
        assert [t[0] for t in whole.tokens_by_position] == list(first.tokens)
        assert [n[0] for n in whole.nll_by_position] == pytest.approx(list(first.nll), abs=1e-9)
        assert [sum(t) for t in whole.tokens_by_position] == list(whole.tokens)
        assert [sum(n) for n in whole.nll_by_position] == pytest.approx(list(whole.nll), abs=1e-9)
        assert all(t[2] == 0 for t in whole.tokens_by_position)
        second = sum(t[1] for t in whole.tokens_by_position)
        assert second > 0
        assert whole.ppl_by_position[1] == pytest.approx(math.exp(sum(n[1] for n in whole.nll_by_position) / second))
        assert math.isnan(whole.ppl_by_position[2])
    doc = long.to_dict()
    assert doc["full_ppl_by_position"]["1-32"] == pytest.approx(head.full_ppl) and doc["full_ppl_by_position"]["129+"] is None
    assert doc["results"][0]["ppl_by_position"]["1-32"] == pytest.approx(head.results[0].ppl)
    assert len(doc["results"][0]["nll_by_position_per_prompt"]) == len(records)

    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--data", str(prompts_file), "--budgets", "0.3",
                               "--methods", "h2o", "--max-new-tokens", "40")
    assert code == 0, stderr
    assert "PPL by answer position" in stdout and "tokens 33-128" in stdout
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--data", str(prompts_file), "--budgets", "0.3",
                               "--methods", "h2o", "--max-new-tokens", "8")
    assert code == 0 and "PPL by answer position" not in stdout  # every answer inside the first bucket


def test_a_draft_holds_the_budget_and_is_reported(loaded, prompts_file, tmp_path):
    """A profile with a draft scores the prompt twice but never holds more than the budget: its
    peak is its kept share, like the plain profile's; the result says how many tokens it drafted
    and in how many rounds."""
    from kvtool.profiles import Draft, save_profile
    from tiny_models import profile_with

    records = load_jsonl(prompts_file)
    results = {}
    for draft in (0, 4):
        profile = profile_with(loaded.model, 0.3, heads="per-head", scorer="window", window=2, pool=1, eviction="tova",
                               draft=Draft(draft, rounds=2) if draft else None,
                               sink_tokens=0, recent_window=1)
        path = tmp_path / f"draft{draft}.yaml"
        save_profile(profile, path)
        config = EvalConfig(methods=("kvtool",), budgets=(profile.budget,), max_new_tokens=8)
        (results[draft],) = evaluate(loaded, data=records, profile=path, config=config).results
    plain, drafted = results[0], results[4]
    assert (plain.draft, drafted.draft) == (0, 4)
    assert (plain.draft_rounds, drafted.draft_rounds) == (1, 2)
    assert drafted.kv_peak_fraction == pytest.approx(plain.kv_peak_fraction, rel=0.05)
    assert drafted.kv_fraction == pytest.approx(plain.kv_fraction, rel=0.05)
    assert drafted.ppl != plain.ppl  # the draft's rows changed what was kept


def test_a_verified_draft_reports_how_much_of_each_answer_it_wrote(loaded, prompts_file, tmp_path):
    """With `draft_verify` the result says so and, per prompt, how many of the output's first tokens
    came from the verified prefix (at least the first, at most the draft); the budget holds as before."""
    from kvtool.profiles import Draft, save_profile
    from tiny_models import profile_with

    records = load_jsonl(prompts_file)
    results = {}
    for verify in (False, True):
        profile = profile_with(loaded.model, 0.3, heads="per-head", scorer="window", window=2, pool=1, eviction="tova",
                               draft=Draft(4, rounds=2, verify=verify), sink_tokens=0, recent_window=1)
        path = tmp_path / f"verify{verify}.yaml"
        save_profile(profile, path)
        config = EvalConfig(methods=("kvtool",), budgets=(profile.budget,), max_new_tokens=8)
        report = evaluate(loaded, data=records, profile=path, config=config)
        (results[verify],) = report.results
        assert report.to_dict()["results"][0]["draft_verify"] is verify
    plain, verified = results[False], results[True]
    assert plain.verified_per_prompt == ()
    assert len(verified.verified_per_prompt) == len(records)
    assert all(1 <= n <= 4 for n in verified.verified_per_prompt)
    assert verified.kv_peak_fraction == pytest.approx(plain.kv_peak_fraction, rel=0.05)


def test_a_kv_format_is_applied_to_every_method_and_reported(loaded, prompts_file):
    records = load_jsonl(prompts_file)
    config = EvalConfig(methods=("tova", "h2o"), budgets=(0.3,), max_new_tokens=4, kv_format="int8")
    report = evaluate(loaded, data=records, config=config)
    doc = report.to_dict()
    assert doc["kv_format"] == "int8" and doc["native_bytes"] == loaded.model.dtype.itemsize
    for row in doc["results"]:
        assert row["kv_fraction_16bit"] == pytest.approx(row["kv_fraction"] * doc["native_bytes"] / 2)
    with pytest.raises(KvtoolError, match="--kv-format takes"):
        EvalConfig(kv_format="int3").checked()
