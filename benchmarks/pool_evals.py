"""The quality targets' table over prompt sets that ran apart: `kvtool eval --json` files pooled.

`compare.py` sets files over the same prompts side by side; this script joins files over different
prompts (the 65 short-answer prompts and the 16 long answers, say, each run on its own) into one
set: per method, PPL pooled over every reference token and its ratio to the full cache's (pooled the
same way), ROUGE-L (mean ± one standard error over prompts), retrieval needles; then each method
minus `--against`, paired over prompts: the PPL ratio's difference, ROUGE-L, and NLL per token.

Each SET argument is one prompt set: a file, or files over the same prompts joined by `+` (a later
file's method replaces an earlier one's, as in compare.py). A method counts only if every set has it.

    .venv/bin/kvtool eval smollm2 --kinds document,image,chat,code,retrieval --budgets 0.2 \\
        --methods kvtool,kvtool-no-draft,tova,h2o --max-new-tokens 256 --json short.json
    .venv/bin/kvtool eval smollm2 --kinds long-answer --budgets 0.2 \\
        --methods kvtool,kvtool-no-draft,tova,h2o --max-new-tokens 256 --json long.json
    .venv/bin/python benchmarks/pool_evals.py --budget 0.2 --against kvtool-no-draft short.json long.json

(`long.json+long-again.json` would join a later run of some methods over the same long answers.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Method:
    """One method's per-prompt figures over every set, in set order."""

    nll: list[float]  # per prompt: summed NLL of its reference tokens
    tokens: list[int]
    rouge: list[float]
    accuracy: list[float | None]

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / sum(self.tokens))

    def per_token(self) -> list[float | None]:
        return [n / t if t else None for n, t in zip(self.nll, self.tokens)]


def read_set(arg: str, budget: float) -> tuple[dict, dict[str, dict]]:
    """(the first file's document, method -> its result at `budget`) of one `+`-joined set."""
    doc, methods = None, {}
    for part in arg.split("+"):
        try:
            loaded = json.loads(Path(part).read_text())
        except OSError as error:
            raise SystemExit(f"error: cannot read {part}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise SystemExit(f"error: {part} is not JSON ({error.msg}, line {error.lineno})") from None
        if not isinstance(loaded, dict) or "full_ppl" not in loaded or not isinstance(loaded.get("results"), list):
            raise SystemExit(f"error: {part} is not a kvtool eval --json file")
        doc = doc or loaded
        methods.update({r["method"]: r for r in loaded["results"] if math.isclose(r["budget"], budget)})
    return doc, methods


def pool(sets: list[tuple[dict, dict[str, dict]]]) -> tuple[float, float | None, dict[str, Method]]:
    """(the full cache's pooled PPL, its needles, each method present in every set pooled)."""
    tokens = [doc["reference_tokens"] for doc, _ in sets]
    full = math.exp(sum(math.log(doc["full_ppl"]) * t for (doc, _), t in zip(sets, tokens)) / sum(tokens))
    needles = [doc.get("full_accuracy") for doc, _ in sets]
    full_needles = next((a for a in needles if a is not None), None) if sum(a is not None for a in needles) == 1 else None
    names = [n for n in sets[0][1] if all(n in methods for _, methods in sets)]
    pooled = {
        name: Method(
            nll=[v for _, m in sets for v in m[name]["nll_per_prompt"]],
            tokens=[v for _, m in sets for v in m[name]["tokens_per_prompt"]],
            rouge=[v for _, m in sets for v in m[name]["rouge_l_per_prompt"]],
            accuracy=[v for _, m in sets for v in (m[name].get("accuracy_per_prompt") or [None] * len(m[name]["rouge_l_per_prompt"]))],
        )
        for name in names
    }
    return full, full_needles, pooled


def _mean_sem(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def needles(method: Method) -> float | None:
    found = [a for a in method.accuracy if a is not None]
    return statistics.fmean(found) if found else None


def table(full: float, full_needles: float | None, methods: dict[str, Method], against: str | None) -> str:
    count = len(next(iter(methods.values())).rouge)
    show = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        f"{count} prompts; full cache PPL {full:.3f}, needles {show(full_needles)}",
        "",
        "| method | PPL | PPL ratio | ROUGE-L | needles |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in methods.items():
        rouge, err = _mean_sem(m.rouge)
        lines.append(f"| {name} | {m.ppl:.3f} | {m.ppl / full:.3f} | {rouge:.3f} ± {err:.3f} | {show(needles(m))} |")
    if against is None:
        return "\n".join(lines)
    if against not in methods:
        raise SystemExit(f"error: no method {against!r} in every set at this budget (have: {', '.join(methods)})")
    base = methods[against]
    lines += ["", f"| {against} minus | PPL ratio | ROUGE-L | ahead / behind | NLL per token | lower on |", "| --- | --- | --- | --- | --- | --- |"]
    for name, m in methods.items():
        if name == against:
            continue
        rouge = [a - b for a, b in zip(base.rouge, m.rouge)]
        nll = [a - b for a, b in zip(base.per_token(), m.per_token()) if a is not None and b is not None]
        r, r_err = _mean_sem(rouge)
        n, n_err = _mean_sem(nll)
        lines.append(
            f"| {name} | {(base.ppl - m.ppl) / full:+.3f} | {r:+.3f} ± {r_err:.3f} | {sum(d > 0 for d in rouge)} / {sum(d < 0 for d in rouge)} "
            f"| {n:+.4f} ± {n_err:.4f} | {sum(d < 0 for d in nll)} of {len(nll)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sets", nargs="+", help="kvtool eval --json files, one prompt set each (files over the same prompts joined by +)")
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--against", help="the method the paired differences start from")
    args = parser.parse_args(argv)
    sets = [read_set(arg, args.budget) for arg in args.sets]
    full, full_needles, methods = pool(sets)
    if not methods:
        raise SystemExit(f"error: no method at budget {args.budget:g} is in every set")
    print(table(full, full_needles, methods, args.against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
