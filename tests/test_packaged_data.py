"""The packaged prompt sets (kvtool/data/*.jsonl): kinds, sizes, lengths, sources, retrieval answers.

Read with the json module, not kvtool's loader: these tests are about the files' content, which
`scripts/make_prompt_sets.py` builds. Only the last two tests need more than the files (the SmolLM2
tokenizer, and for regeneration the same Python and Debian texts); they skip without them.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "kvtool" / "data"
KINDS = {"document", "image", "chat", "code", "retrieval", "long-answer"}
# Calibration has every kind, its long-answer rows scored on 256-token references (config.LONG_REFERENCE_TOKENS).
CALIBRATION_KINDS = KINDS
NOISE = "RULER noise filler"  # the fixed filler paragraph both sets' noise haystacks repeat
REQUIRED = {"prompt", "kind", "task", "sources", "tokens_smollm2"}
OPTIONAL = {"answers", "note"}
NEEDLE = re.compile(r"One of the special magic numbers for ([\w-]+) is: (\d{7})\.")
SEVEN_DIGITS = re.compile(r"(?<!\d)\d{7}(?!\d)")
# What `kvtool eval --max-prompt-tokens 2048` keeps uncut, with room to spare.
MOST_TOKENS = 2000


def rows(name: str) -> list[dict]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


EVALUATION, CALIBRATION = rows("evaluation.jsonl"), rows("calibration.jsonl")
BOTH = [pytest.param(EVALUATION, id="evaluation"), pytest.param(CALIBRATION, id="calibration")]


@pytest.mark.parametrize("records", BOTH)
def test_every_row_has_the_documented_fields(records: list[dict]) -> None:
    for row in records:
        assert REQUIRED <= set(row) and set(row) <= REQUIRED | OPTIONAL, sorted(row)
        assert isinstance(row["prompt"], str) and row["prompt"] == row["prompt"].strip() and row["prompt"]
        assert row["kind"] in KINDS and isinstance(row["task"], str) and row["task"]
        assert row["sources"] and all(isinstance(s, str) and s for s in row["sources"])
        assert isinstance(row["tokens_smollm2"], int)
        # Exact answers belong to retrieval rows, and every retrieval row has them.
        assert ("answers" in row) == (row["kind"] == "retrieval")
    assert len({r["prompt"] for r in records}) == len(records)


def test_evaluation_covers_six_kinds_with_at_least_twelve_prompts_each() -> None:
    kinds = Counter(r["kind"] for r in EVALUATION)
    assert set(kinds) == KINDS
    assert min(kinds.values()) >= 12 and kinds["long-answer"] >= 16
    assert {r["task"] for r in EVALUATION if r["kind"] == "long-answer"} == {"study-guide", "walkthrough", "implement", "tutorial-chat"}
    # Every prompt costs eval time per method and budget on a 2-core CPU (--kinds narrows a run).
    assert len(EVALUATION) <= 85


def test_calibration_covers_the_same_kinds() -> None:
    kinds = Counter(r["kind"] for r in CALIBRATION)
    assert set(kinds) == CALIBRATION_KINDS and min(kinds.values()) >= 8
    # Rows are interleaved by kind, so the leading rows (and any sample) mix the kinds.
    assert {r["kind"] for r in CALIBRATION[: len(CALIBRATION_KINDS)]} == CALIBRATION_KINDS
    assert {r["kind"] for r in EVALUATION[: len(KINDS)]} == KINDS


def test_no_source_is_shared_between_evaluation_and_calibration() -> None:
    def sources(records: list[dict]) -> set[str]:
        return {s for r in records for s in r["sources"]} - {NOISE}

    assert not sources(EVALUATION) & sources(CALIBRATION)
    assert not {r["prompt"] for r in EVALUATION} & {r["prompt"] for r in CALIBRATION}
    # Several sources per kind: no kind is one text seen many times.
    for records, kinds in ((EVALUATION, KINDS), (CALIBRATION, CALIBRATION_KINDS)):
        for kind in kinds:
            assert len({s for r in records if r["kind"] == kind for s in r["sources"]} - {NOISE}) >= 3, kind


@pytest.mark.parametrize("records", BOTH)
def test_retrieval_answers_are_the_asked_needles_and_nothing_else(records: list[dict]) -> None:
    retrieval = [r for r in records if r["kind"] == "retrieval"]
    assert retrieval
    variants = Counter()
    for row in retrieval:
        prompt, answers = row["prompt"], row["answers"]
        needles = NEEDLE.findall(prompt)
        asked = {key for key, value in needles if value in answers}
        assert len(asked) == 1, row["task"]
        (key,) = asked
        # The answers are exactly the values of the asked key's needles, each written once.
        assert sorted(answers) == sorted(value for k, value in needles if k == key)
        assert all(prompt.count(value) == 1 for value in answers)
        # No other 7-digit number in the prompt could pass for one, and the key appears only in
        # its needles and in the question that closes the prompt.
        assert sorted(SEVEN_DIGITS.findall(prompt)) == sorted(value for _, value in needles)
        assert prompt.count(key) == len(answers) + 1 and key in prompt.rsplit("\n\n", 1)[-1]
        variants[("several keys" if len({k for k, _ in needles}) > 1 else "one key", len(answers) > 1)] += 1
    # RULER's variants: one needle, several keys (one asked), several values for one key (all asked).
    assert {("one key", False), ("several keys", False), ("one key", True)} <= set(variants)
    assert {row["task"].rsplit("-", 1)[1] for row in retrieval} == {"noise", "essay"}


@pytest.mark.parametrize("records", BOTH)
def test_prompt_lengths_are_in_range(records: list[dict]) -> None:
    for row in records:
        tokens, chars = row["tokens_smollm2"], len(row["prompt"])
        # A long-answer request can be short: its answer is what fills the cache.
        assert (150 if row["kind"] == "long-answer" else 400) <= tokens <= MOST_TOKENS, (row["kind"], tokens)
        if row["kind"] != "retrieval":
            assert tokens <= 1500, (row["kind"], tokens)
        # About 2 (boxes, code) to 5 (prose) characters a token.
        assert 1.5 * tokens <= chars <= 6 * tokens, (row["kind"], tokens, chars)
    if records is EVALUATION:
        assert all(r["tokens_smollm2"] >= 1000 for r in records if r["kind"] == "retrieval")


def _tokenizer_dir() -> Path | None:
    cache = Path(os.environ.get("KVTOOL_CACHE") or Path.home() / ".cache" / "kvtool").expanduser()
    found = sorted(glob.glob(str(cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1-*" / "tokenizer.json")))
    return Path(found[-1]).parent if found else None


def test_recorded_token_counts_are_smollm2s() -> None:
    where = _tokenizer_dir()
    if where is None:
        pytest.skip("the embedded SmolLM2 is not converted yet (its tokenizer measures the prompts)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(where))
    for row in EVALUATION + CALIBRATION:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == row["tokens_smollm2"]


@pytest.mark.slow
def test_the_generator_rebuilds_the_packaged_files_byte_for_byte() -> None:
    if sys.version_info[:3] != (3, 11, 7):
        pytest.skip("the packaged sets were built from Python 3.11.7's standard library texts")
    if _tokenizer_dir() is None or not Path("/usr/share/doc/man-db/man-db-manual.txt.gz").exists():
        pytest.skip("needs the SmolLM2 tokenizer and Debian's man-db manual")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_prompt_sets.py"), "--check"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
