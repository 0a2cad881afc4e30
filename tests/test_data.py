"""Prompt files (kvtool.data): the shipped sets, seeded selection and hash, and every bad line as
one named error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.data import Record, dataset_hash, load_jsonl, packaged_data, select_samples
from kvtool.errors import KvtoolError


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_shipped_data_has_enough_long_prompts() -> None:
    calibration, evaluation = load_jsonl(), load_jsonl(packaged_data("evaluation.jsonl"))
    assert len(calibration) >= 24 and len(evaluation) >= 20
    assert not {r.prompt for r in calibration} & {r.prompt for r in evaluation}
    # Long enough for compression to matter. Measured in tokens (recorded per row by the generator,
    # re-counted in test_packaged_data): the image prompts' boxes run about 2 characters a token,
    # prose about 4, so a character threshold would say little.
    lines = packaged_data("calibration.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(calibration)
    assert all(json.loads(line)["tokens_smollm2"] >= 400 for line in lines)
    assert all(len(r.prompt) > 1000 for r in calibration)


def test_shipped_evaluation_never_sees_a_calibration_source() -> None:
    def sources(name: str) -> set[str]:
        lines = packaged_data(name).read_text(encoding="utf-8").splitlines()
        # Every source text or generator vocabulary a prompt was built from; RULER's fixed noise
        # filler is not a source text, and both sets' retrieval haystacks may use it.
        return {s for line in lines for s in json.loads(line)["sources"]} - {"RULER noise filler"}

    calibration, evaluation = sources("calibration.jsonl"), sources("evaluation.jsonl")
    assert len(evaluation) >= 40
    assert not calibration & evaluation


def test_selection_and_hash_follow_the_seed(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": f"prompt {i}"}) for i in range(10)])
    records = load_jsonl(path)
    first, again = select_samples(records, 4, seed=3), select_samples(records, 4, seed=3)
    assert first == again and len(set(first)) == 4
    assert dataset_hash(first) == dataset_hash(again) != dataset_hash(select_samples(records, 4, seed=4))
    # Line endings and surrounding whitespace are normalized before hashing.
    crlf = write_lines(tmp_path / "e.jsonl", [json.dumps({"prompt": f" prompt {i}\r\n"}) for i in range(10)])
    assert dataset_hash(select_samples(load_jsonl(crlf), 4, seed=3)) == dataset_hash(first)
    with pytest.raises(KvtoolError, match="asked for 11 samples but .* has only 10 prompts"):
        select_samples(records, 11, seed=0)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "no prompts (the file is empty)"),
        (["", "   "], "no prompts (the file is empty)"),
        (['{"prompt": "a"}', '{"prompt": "b",}'], "line 2: not valid JSON"),
        (['{"prompt": "a"}', "", '["x"]'], "line 3: expected a JSON object"),
        (['{"answer": "a"}'], 'line 1: missing the "prompt" field'),
        (['{"prompt": "  "}'], 'line 1: "prompt" is empty'),
        (['{"prompt": 3}'], 'line 1: "prompt" must be a string'),
        (['{"prompt": "a", "answer": 3}'], 'line 1: "answer" must be a string or null'),
    ],
)
def test_bad_data_files_name_the_problem(tmp_path: Path, lines: list[str], message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(KvtoolError) as caught:
        load_jsonl(path)
    assert message in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_data_file(tmp_path: Path) -> None:
    with pytest.raises(KvtoolError, match="no such data file"):
        load_jsonl(tmp_path / "nope.jsonl")




def test_kind_and_answers_are_read_when_given(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "where is the cat", "kind": "retrieval", "answers": ["on the mat", " the mat\r\n"]}),
        json.dumps({"prompt": "summarize this", "answer": "a summary", "kind": "document"}),
        json.dumps({"prompt": "plain"}),
    ])
    retrieval, document, plain = load_jsonl(path)
    assert retrieval.kind == "retrieval" and retrieval.answers == ("on the mat", "the mat")
    assert retrieval.answer is None  # "answers" are exact answers, not the PPL reference text
    assert document.kind == "document" and document.answers == () and document.answer == "a summary"
    assert plain.kind is None and plain.answers == ()


def test_kind_and_answers_leave_the_dataset_hash_alone(tmp_path: Path) -> None:
    # The model never sees them; profiles calibrated before they existed keep their hash.
    plain = load_jsonl(write_lines(tmp_path / "a.jsonl", [json.dumps({"prompt": "p"})]))
    tagged = load_jsonl(write_lines(tmp_path / "b.jsonl", [json.dumps({"prompt": "p", "kind": "k", "answers": ["x"]})]))
    assert dataset_hash(plain) == dataset_hash(tagged) == dataset_hash([Record(prompt="p")])


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ('"kind": 3', '"kind" must be a string, got int'),
        ('"kind": ["document"]', '"kind" must be a string, got list'),
        ('"kind": "  "', '"kind" is empty'),
        ('"answers": "the mat"', '"answers" must be a list of strings (the exact answers), got str'),
        ('"answers": ["the mat", 3]', '"answers" must be a list of strings (the exact answers), got a list with non-strings'),
        ('"answers": []', '"answers" is an empty list'),
        ('"answers": ["the mat", " "]', '"answers" has an empty answer'),
    ],
    ids=["kind-int", "kind-list", "kind-empty", "answers-string", "answers-non-string", "answers-none", "answers-blank"],
)
def test_bad_kind_and_answers_name_the_line(tmp_path: Path, field: str, message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "a"}', '{"prompt": "b", ' + field + "}"])
    with pytest.raises(KvtoolError) as caught:
        load_jsonl(path)
    text = str(caught.value)
    assert text.startswith(f"{path} line 2: ") and message in text and "\n" not in text


def test_kinds_per_kind_and_long_prompts_select_from_the_packaged_set() -> None:
    from kvtool.data import EVALUATION_DATA, of_kinds
    from kvtool.data.long_prompts import CHARS_PER_TOKEN, first_per_kind, long_prompts

    pool = load_jsonl(packaged_data(EVALUATION_DATA))
    long = of_kinds(pool, ["long-answer"])
    assert len(long) >= 16 and all(r.kind == "long-answer" for r in long)
    short = of_kinds(pool, ["document", "code"])
    assert [r.prompt for r in short] == [r.prompt for r in pool if r.kind in ("document", "code")]  # file order
    firsts = first_per_kind(pool, 1)
    assert [r.kind for r in firsts] == list(dict.fromkeys(r.kind for r in pool))
    built = long_prompts(firsts, pool, 2000)
    for record, made in zip(firsts, built):
        assert record.prompt in made.prompt and made.kind == record.kind and made.answers == record.answers
        assert len(made.prompt) >= 2000 * CHARS_PER_TOKEN
    with pytest.raises(KvtoolError, match="no prompts of kind 'poems'"):
        of_kinds(pool, ["poems"])
