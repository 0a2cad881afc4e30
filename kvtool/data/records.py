"""Prompt sets (calibration and evaluation): JSONL loading, seeded sample selection, the dataset hash.

A data file has one JSON object per line, `{"prompt": "...", "answer": "..."}`, the answer optional
(without one, calibration and evaluation score the model's own full-cache continuation). A line may carry
`"images": ["a.png", ...]` for a vision-language model: paths relative to the data file's directory,
checked to exist here and opened when the prompt is encoded (`kvtool.models.images`). Two more optional
fields describe a prompt for accuracy scoring: `"kind"` (what sort of task, e.g. "document",
"retrieval") and `"answers"` (the exact answers that count as correct; unlike `"answer"`, which is a
reference text whose perplexity is measured). Other keys are allowed and ignored, so a file can carry
its own metadata (the shipped sets record their sources). Blank lines are skipped. Every problem is a
one-line KvtoolError naming the file and, where there is one, the line.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvtool.errors import KvtoolError

DEFAULT_DATA = "calibration.jsonl"
EVALUATION_DATA = "evaluation.jsonl"


@dataclass(frozen=True)
class Record:
    """One calibration sample; `where` says where it came from (for error messages)."""

    prompt: str
    answer: str | None = None
    where: str = ""
    # Absolute image paths, in the order the prompt's image placeholders take them.
    images: tuple[str, ...] = ()
    # What sort of task the prompt is ("document", "retrieval", ...); None when the file does not say.
    kind: str | None = None
    # Exact answers that count as correct (accuracy scoring); empty when the file gives none.
    answers: tuple[str, ...] = ()

    def describe(self, index: int) -> str:
        """`sample 3 (calibration.jsonl line 17)`: how messages name a selected sample."""
        return f"sample {index + 1} ({self.where})" if self.where else f"sample {index + 1}"


def packaged_data(name: str = DEFAULT_DATA) -> Path:
    """Path of a prompt set shipped inside the package."""
    return Path(str(resources.files("kvtool") / "data" / name))


def _normalize(text: str) -> str:
    # The hash must not change with the editor's line endings or a trailing newline, and what is
    # hashed is exactly what the model sees.
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def load_jsonl(path: str | Path | None = None) -> tuple[Record, ...]:
    """Read a JSONL prompt file (default: the shipped calibration set)."""
    source = Path(path) if path is not None else packaged_data()
    name = str(path) if path is not None else source.name
    if not source.exists():
        raise KvtoolError(f"{name}: no such data file")
    if source.is_dir():
        raise KvtoolError(f"{name}: is a directory, not a JSONL data file")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvtoolError(f"{name}: not UTF-8 text") from None
    except OSError as exc:
        raise KvtoolError(f"{name}: cannot read ({exc.strerror or exc})") from exc
    base = source.resolve().parent
    records = [
        _parse_line(line, f"{name} line {number}", base)
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not records:
        raise KvtoolError(f"{name}: no prompts (the file is empty); expected JSONL lines like {{\"prompt\": \"...\"}}")
    return tuple(records)


def _parse_line(line: str, where: str, base: Path) -> Record:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise KvtoolError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise KvtoolError(f"{where}: expected a JSON object like {{\"prompt\": \"...\"}}, got {type(item).__name__}")
    if "prompt" not in item:
        raise KvtoolError(f"{where}: missing the \"prompt\" field")
    prompt = item["prompt"]
    if not isinstance(prompt, str):
        raise KvtoolError(f"{where}: \"prompt\" must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise KvtoolError(f"{where}: \"prompt\" is empty")
    answer = item.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise KvtoolError(f"{where}: \"answer\" must be a string or null, got {type(answer).__name__}")
    if answer is not None and not answer.strip():
        raise KvtoolError(f"{where}: \"answer\" is empty (leave it out to score the model's own continuation)")
    return Record(
        prompt=_normalize(prompt),
        answer=None if answer is None else _normalize(answer),
        where=where,
        images=_parse_images(item.get("images"), where, base),
        kind=_parse_kind(item.get("kind"), where),
        answers=_parse_answers(item.get("answers"), where),
    )


def _parse_kind(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise KvtoolError(f"{where}: \"kind\" must be a string, got {type(value).__name__}")
    if not value.strip():
        raise KvtoolError(f"{where}: \"kind\" is empty (leave it out when the prompt has none)")
    return value.strip()


def _parse_answers(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        got = type(value).__name__ if not isinstance(value, list) else "a list with non-strings"
        raise KvtoolError(f"{where}: \"answers\" must be a list of strings (the exact answers), got {got}")
    if not value:
        raise KvtoolError(f"{where}: \"answers\" is an empty list (leave it out when the prompt has none)")
    if any(not a.strip() for a in value):
        raise KvtoolError(f"{where}: \"answers\" has an empty answer")
    return tuple(_normalize(a) for a in value)


def _parse_images(value: object, where: str, base: Path) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        got = type(value).__name__ if not isinstance(value, list) else "a list with non-strings"
        raise KvtoolError(f"{where}: \"images\" must be a list of image paths (strings), got {got}")
    paths = []
    for entry in value:
        if not entry.strip():
            raise KvtoolError(f"{where}: \"images\" has an empty path")
        path = (base / Path(entry).expanduser()).resolve()
        if not path.exists():
            raise KvtoolError(f"{where}: image {entry} does not exist (looked for {path})")
        if not path.is_file():
            raise KvtoolError(f"{where}: image {entry} is not a file ({path})")
        paths.append(str(path))
    return tuple(paths)


def select_samples(records: Sequence[Record], samples: int, seed: int) -> tuple[Record, ...]:
    """`samples` distinct records drawn with `seed`, in file order (same seed, same selection)."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise KvtoolError(f"samples must be a positive integer, got {samples!r}")
    if samples > len(records):
        origin = records[0].where.rsplit(" line ", 1)[0] if records and records[0].where else "the data"
        raise KvtoolError(f"asked for {samples} samples but {origin} has only {len(records)} prompts")
    chosen = sorted(random.Random(seed).sample(range(len(records)), samples))
    return tuple(records[i] for i in chosen)


def select_by_kind(records: Sequence[Record], samples: int, seed: int) -> tuple[Record, ...]:
    """`samples` distinct records drawn with `seed`, spread evenly over the records' kinds (round
    robin over the kinds in order of first appearance, each kind's records in a seeded random
    order), then in file order. Records without a kind form one kind of their own."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise KvtoolError(f"samples must be a positive integer, got {samples!r}")
    if samples > len(records):
        return select_samples(records, samples, seed)  # its error names the shortfall
    rng = random.Random(seed)
    groups: dict[str | None, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(record.kind, []).append(i)
    queues = [rng.sample(members, len(members)) for members in groups.values()]
    picked: list[int] = []
    while len(picked) < samples:
        for queue in queues:
            if queue and len(picked) < samples:
                picked.append(queue.pop(0))
    return tuple(records[i] for i in sorted(picked))


def of_kinds(records: Sequence[Record], kinds: Sequence[str]) -> tuple[Record, ...]:
    """The records of `kinds`, in file order; a kind the records do not have is an error naming those they do."""
    known = list(dict.fromkeys(r.kind for r in records if r.kind is not None))
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise KvtoolError(f"no prompts of kind {unknown[0]!r} (the data has: {', '.join(known) or 'no kinds'})")
    return tuple(r for r in records if r.kind in kinds)


def split_by_kind(records: Sequence[Record]) -> tuple[tuple[Record, ...], tuple[Record, ...]]:
    """Two disjoint halves with each kind spread over both: within a kind, records alternate
    between the first half and the second (the first gets the odd one out)."""
    seen: dict[str | None, int] = {}
    first, second = [], []
    for record in records:
        position = seen.get(record.kind, 0)
        seen[record.kind] = position + 1
        (first if position % 2 == 0 else second).append(record)
    return tuple(first), tuple(second)


def dataset_hash(records: Sequence[Record]) -> str:
    """sha256 over the selected records' normalized prompt and answer, in order, and the content
    (not the path) of each record's images where it has any.

    `kind` and `answers` are left out: the model never sees them, and profiles calibrated before
    they existed keep their hash."""
    canonical = json.dumps(
        [_hashed(r) for r in records],
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _hashed(record: Record) -> dict:
    item: dict = {"prompt": record.prompt, "answer": record.answer}
    if record.images:  # text-only records hash as they always did
        item["images"] = [_file_sha256(path) for path in record.images]
    return item


def _file_sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise KvtoolError(f"image {path}: cannot read ({exc.strerror or exc})") from None
