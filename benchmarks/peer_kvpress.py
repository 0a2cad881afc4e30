"""NVIDIA kvpress presses under `kvtool eval`'s protocol, for a side-by-side table.

kvpress 0.5.5 pins transformers < 5.3 while kvtool needs a newer one, so this script runs in its own
virtual environment (`benchmarks/peer_kvpress_setup.sh` builds it and runs the script) and imports
nothing from kvtool: the protocol pieces it needs are restated here, each next to the kvtool code it
mirrors, so the two tools are judged the same way:

- each prompt is one user turn through the tokenizer's chat template with the generation prompt,
  cut in the middle above `--max-prompt-tokens` (kvtool.scoring.encoding.encode_prompt);
- batch size 1; greedy decoding of `--max-new-tokens`, stopping at EOS (which is kept and scored);
- the full cache's greedy output is the reference, or the `full_outputs` of a `kvtool eval --json`
  file given with `--references`, so both tools are judged against the very same references;
- PPL = exp(mean NLL) pooled over all reference tokens, teacher-forced token by token through the
  compressed cache (new tokens at their true positions, not at the compressed cache's length);
- ROUGE-L F1 (rouge-score, as kvtool.evaluation.metrics) of the compressed greedy output against the
  full cache's; accuracy on rows with "answers": the share of answer strings found in the output,
  case-insensitive (RULER's string-match-all), averaged over answer rows;
- kv_fraction: KV entries the compressed cache holds at the end of greedy generation over those a
  full cache holds for the same tokens, pooled over prompts; a sliding-window layer's full cache
  holds its window only (as transformers stores it), so on Gemma 3 this is the whole cache's share.

On a model with sliding-window layers (Gemma 3) the presses leave those layers whole, as kvpress
does for Gemma 3 (it keys the skip to the multimodal class only): a budget is then the global
layers' share, and the whole cache's share, kv_fraction, is larger.

kvpress presses compress the prompt once, in its forward (`with press(model):`), and leave the
cache growing while generating: those rows are `prompt_only`. kvpress's decoding-time wrapper
(`PrefillDecodingPress` with a `CompressionRatioDecodingPress`, compressing after every new token)
holds the budget over all tokens seen; it is offered as the separate `*_decoding` presses.

`--quantized-cache 4` (or 2) stores every press's cache in transformers' `QuantizedCache` (the quanto
backend, which kvpress's presses dequantize, compress and quantize again): then kv_fraction is the
share of the full cache's bytes the tensors hold (codes, scales, zero points and the full-precision
residual), and kv_fraction_16bit the same with the floating-point parts at 16 bits, for a side by side
with `kvtool eval --kv-format` at the same bytes (the setup script installs optimum-quanto).

Usage (the wrapper builds `.venv-kvpress/` on first use and finds the converted smollm2):

    benchmarks/peer_kvpress_setup.sh run --budgets 0.2 --references eval.json --json kvpress.json

where eval.json is `kvtool eval --json`'s output on the same data (its `full_outputs`). Without
`--references` the full cache's outputs are computed here and written in the same format.

torch, transformers and kvpress are imported inside functions, so the helpers here can be imported
and tested where kvpress is not installed.

Over 400 lines because it must be one self-contained file: it runs in kvpress's environment, where
kvtool cannot be imported, so the protocol it restates cannot be split into kvtool modules.

Feeds the kvpress rows of README.md "Quality against the peers" and docs/results.md (the files
docs/results/eval-smollm2-b0.2-kvpress-*.json), printed beside kvtool's by benchmarks/compare.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "kvtool" / "data" / "evaluation.jsonl"
DEFAULT_PRESSES = (
    "tova", "snapkv", "streamingllm", "expected_attention", "adakv_expected_attention", "knorm", "tova_decoding",
)
DEFAULT_BUDGETS = (0.1, 0.2, 0.5)
DEFAULT_MAX_NEW_TOKENS = 64
# kvtool eval's default (EvalConfig.max_prompt_tokens); pass the same value to both tools.
DEFAULT_MAX_PROMPT_TOKENS = 2048
# kvtool.scoring.encoding: the middle of an over-long prompt goes, 3/4 of what stays from its start.
ELISION = "\n[...]\n"
HEAD_SHARE = 0.75
SNAPKV_WINDOW = 64  # SnapKVPress's default window_size; it refuses prompts not longer than this


class PeerError(Exception):
    """A problem with the arguments or the input files, reported as one line."""


@dataclass(frozen=True)
class PressSpec:
    name: str
    description: str  # the kvpress object, in words
    prompt_only: bool
    build: Callable[[Any, float], Any]  # (kvpress module, compression_ratio) -> press or None

    @property
    def method(self) -> str:
        return f"kvpress:{self.name}"


def _held(scorer: str) -> Callable[[Any, float], Any]:
    """Prompt compressed by `scorer`, then one eviction after every new token, so the cache keeps
    the budget's share of all tokens seen (kvtool's held mode, the fixed point of TOVA's rule)."""

    def build(kvpress: Any, ratio: float) -> Any:
        return kvpress.PrefillDecodingPress(
            prefilling_press=getattr(kvpress, scorer)(compression_ratio=ratio),
            decoding_press=kvpress.CompressionRatioDecodingPress(
                base_press=getattr(kvpress, scorer)(), target_compression_ratio=ratio, compression_interval=1,
            ),
        )

    return build


PRESSES: dict[str, PressSpec] = {
    spec.name: spec
    for spec in (
        PressSpec("none", "no press (the full cache through this script: a sanity row)", True, lambda kv, r: None),
        PressSpec("tova", "TOVAPress", True, lambda kv, r: kv.TOVAPress(compression_ratio=r)),
        PressSpec("snapkv", "SnapKVPress (window 64, kernel 5)", True, lambda kv, r: kv.SnapKVPress(compression_ratio=r)),
        PressSpec("streamingllm", "StreamingLLMPress (4 sink tokens)", True, lambda kv, r: kv.StreamingLLMPress(compression_ratio=r)),
        PressSpec(
            "expected_attention", "ExpectedAttentionPress", True,
            lambda kv, r: kv.ExpectedAttentionPress(compression_ratio=r),
        ),
        PressSpec(
            "adakv_expected_attention", "AdaKVPress(ExpectedAttentionPress)", True,
            lambda kv, r: kv.AdaKVPress(kv.ExpectedAttentionPress(compression_ratio=r)),
        ),
        PressSpec("knorm", "KnormPress", True, lambda kv, r: kv.KnormPress(compression_ratio=r)),
        PressSpec(
            "tova_decoding", "PrefillDecodingPress(TOVAPress, CompressionRatioDecodingPress(TOVAPress, interval 1))",
            False, _held("TOVAPress"),
        ),
        PressSpec(
            "knorm_decoding", "PrefillDecodingPress(KnormPress, CompressionRatioDecodingPress(KnormPress, interval 1))",
            False, _held("KnormPress"),
        ),
        PressSpec(
            "streamingllm_decoding",
            "PrefillDecodingPress(StreamingLLMPress, CompressionRatioDecodingPress(StreamingLLMPress, interval 1))",
            False, _held("StreamingLLMPress"),
        ),
    )
}


def compression_ratio(budget: float) -> float:
    """kvpress's compression_ratio is the share removed; a kvtool budget is the share kept."""
    return 1.0 - budget


# ---------------------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class Options:
    model_dir: Path
    data: Path
    presses: tuple[str, ...]
    budgets: tuple[float, ...]
    max_new_tokens: int
    max_prompt_tokens: int
    limit: int | None
    references: Path | None
    json_out: Path | None
    threads: int | None = None
    kinds: tuple[str, ...] | None = None  # only the rows of these kinds (as `kvtool eval --kinds`)
    quantized: Quantized | None = None  # transformers' quanto cache instead of the full-precision one


@dataclass(frozen=True)
class Quantized:
    """transformers' `QuantizedCache(backend="quanto")`, the quantized cache kvpress's presses accept:
    every entry at `bits` (asymmetric, one scale and zero point per group of `group` values, in the
    model's dtype; a group is one head's vector at head dim 64), the newest tokens at full precision
    until `residual` of them are waiting, then quantized with the rest."""

    bits: int
    residual: int = 128  # transformers' default residual_length
    group: int = 64  # transformers' default q_group_size

    @property
    def name(self) -> str:
        return f"quanto int{self.bits} g{self.group} residual {self.residual}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage and exit
        raise PeerError(message)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise PeerError("--presses is empty")
    unknown = [n for n in names if n not in PRESSES]
    if unknown:
        raise PeerError(f"unknown press {unknown[0]!r} (choose from: {', '.join(PRESSES)})")
    return names


def _budgets(text: str) -> tuple[float, ...]:
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise PeerError(f"budget must be a number, got {part!r}") from None
        if not 0.0 < value <= 1.0:  # NaN fails too
            raise PeerError(f"budget must be a kept fraction in (0, 1] (0.2 keeps 20% of the KV cache), got {part}")
        values.append(value)
    if not values:
        raise PeerError("--budgets is empty")
    return tuple(dict.fromkeys(values))


def parse_args(argv: Sequence[str]) -> Options:
    parser = _Parser(prog="peer_kvpress.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="a Hugging Face model directory")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="JSONL: {prompt, kind?, answers?} per line")
    parser.add_argument("--presses", default=",".join(DEFAULT_PRESSES), help=f"comma list of: {', '.join(PRESSES)}")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS), help="kept fractions")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS)
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--kinds", help="comma list: only the prompts of these kinds, in data order (as kvtool eval --kinds)")
    parser.add_argument("--references", type=Path, help="a kvtool eval --json file whose full_outputs to use")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the results here")
    parser.add_argument(
        "--quantized-cache", type=int, choices=(2, 4), metavar="BITS",
        help="store the cache in transformers' quanto QuantizedCache at 2 or 4 bits (needs optimum-quanto)",
    )
    parser.add_argument("--residual-length", type=int, default=128, help="with --quantized-cache: newest tokens kept at full precision")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's); 1 where other jobs share the cores"
    )
    args = parser.parse_args(list(argv))
    if args.max_new_tokens < 1:
        raise PeerError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_prompt_tokens < 16:
        raise PeerError(f"--max-prompt-tokens must be at least 16, got {args.max_prompt_tokens}")
    if args.threads is not None and args.threads < 1:
        raise PeerError(f"--threads must be at least 1, got {args.threads}")
    if args.residual_length < 1:
        raise PeerError(f"--residual-length must be at least 1, got {args.residual_length}")
    if args.limit is not None and args.limit < 1:
        raise PeerError(f"--limit must be at least 1, got {args.limit}")
    kinds = None if args.kinds is None else tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip()))
    if kinds == ():
        raise PeerError("--kinds is empty")
    if not (args.model_dir / "config.json").is_file():
        raise PeerError(f"--model-dir {args.model_dir}: not a Hugging Face model directory (no config.json)")
    if args.json_out is not None and args.json_out.is_dir():
        raise PeerError(f"--json {args.json_out}: is a directory")
    return Options(
        model_dir=args.model_dir, data=args.data, presses=_names(args.presses), budgets=_budgets(args.budgets),
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, limit=args.limit,
        references=args.references, json_out=args.json_out, threads=args.threads, kinds=kinds,
        quantized=None if args.quantized_cache is None else Quantized(args.quantized_cache, args.residual_length),
    )


# ---------------------------------------------------------------------------------------- input files


@dataclass(frozen=True)
class Row:
    prompt: str
    kind: str | None = None
    answers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Reference:
    text: str
    token_ids: tuple[int, ...]


def _normalize(text: str) -> str:
    # As kvtool.calibration.data: the model sees the prompt without CR line ends or outer blanks.
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _read_text(path: Path, what: str) -> str:
    if not path.exists():
        raise PeerError(f"{path}: no such {what}")
    if path.is_dir():
        raise PeerError(f"{path}: is a directory, not a {what}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PeerError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise PeerError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _parse_row(line: str, where: str) -> Row:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PeerError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise PeerError(f"{where}: expected a JSON object like {{\"prompt\": \"...\"}}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PeerError(f"{where}: \"prompt\" must be a non-empty string")
    kind = item.get("kind")
    if kind is not None and (not isinstance(kind, str) or not kind.strip()):
        raise PeerError(f"{where}: \"kind\" must be a non-empty string")
    answers = item.get("answers")
    if answers is not None:
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise PeerError(f"{where}: \"answers\" must be a non-empty list of non-empty strings")
        answers = tuple(answers)
    return Row(prompt=_normalize(prompt), kind=kind, answers=answers)


def load_rows(path: Path, limit: int | None = None, kinds: Sequence[str] | None = None) -> list[Row]:
    text = _read_text(path, "data file")
    rows = [_parse_row(line, f"{path} line {n}") for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not rows:
        raise PeerError(f"{path}: no prompts")
    if kinds is not None:
        present = sorted({r.kind for r in rows if r.kind is not None})
        missing = [k for k in kinds if k not in present]
        if missing:
            raise PeerError(f"{path}: no prompts of kind {missing[0]!r} (its kinds: {', '.join(present) or 'none'})")
        rows = [r for r in rows if r.kind in kinds]
    return rows[:limit] if limit is not None else rows


def load_references(path: Path, count: int) -> list[Reference]:
    """The first `count` full-cache outputs of a kvtool eval --json file, in data order."""
    try:
        doc = json.loads(_read_text(path, "references file"))
    except json.JSONDecodeError as exc:
        raise PeerError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    outputs = doc.get("full_outputs") if isinstance(doc, dict) else None
    if not isinstance(outputs, list):
        raise PeerError(f"{path}: no \"full_outputs\" list (write it with kvtool eval --json)")
    if len(outputs) < count:
        raise PeerError(f"{path}: has {len(outputs)} full outputs for {count} prompts: not the same data")
    references = []
    for index, item in enumerate(outputs[:count]):
        ids = item.get("token_ids") if isinstance(item, dict) else None
        text = item.get("text") if isinstance(item, dict) else None
        if (
            not isinstance(text, str) or not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise PeerError(f"{path}: full_outputs[{index}] must be {{\"text\": str, \"token_ids\": [int, ...]}}")
        references.append(Reference(text=text, token_ids=tuple(ids)))
    return references


# ---------------------------------------------------------------------------------------- metrics


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l_f1(prediction: str, target: str) -> float:
    """As kvtool.evaluation.metrics.rouge_l_f1: two empty outputs agree perfectly."""
    if not prediction.strip() and not target.strip():
        return 1.0
    return float(_scorer().score(target, prediction)["rougeL"].fmeasure)


def answer_accuracy(output: str, answers: Sequence[str]) -> float:
    """RULER's string-match-all: the share of expected answers found in the output, ignoring case."""
    found = output.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def standard_error(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def _json_number(x: float | None) -> float | None:
    # JSON has no NaN (one prompt has no standard error; no tokens, no PPL).
    return None if x is None or math.isnan(x) else x


@dataclass
class PromptScore:
    """What one prompt gave one press (or the full cache)."""

    nll_sum: float
    tokens: int
    output: str
    rouge_l: float | None  # None for the full cache itself
    accuracy: float | None  # None without answers
    kv_kept: int = 0  # KV entries at the end of greedy generation (effective: masked ones not counted)
    kv_physical: int = 0  # entries stored, masked or not
    kv_full: int = 0  # entries a full cache holds for the same tokens
    kv_bytes: int = 0  # bytes the cache's tensors hold at the end of greedy generation (codes, scales, zeros)
    kv_full_bytes: int = 0  # bytes a full-precision full cache holds for the same tokens
    kv_bytes_16bit: int = 0  # kv_bytes with every floating-point value at 2 bytes (a 16-bit model's cache)


def _pooled_ppl(scores: Sequence[PromptScore]) -> float:
    tokens = sum(s.tokens for s in scores)
    return math.exp(sum(s.nll_sum for s in scores) / tokens) if tokens else math.nan


def _mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _group(scores: Sequence[PromptScore], rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, list[PromptScore]] = {}
    for score, row in zip(scores, rows):
        if row.kind is not None:
            kinds.setdefault(row.kind, []).append(score)
    out = {}
    for kind, members in kinds.items():
        rouge = [s.rouge_l for s in members if s.rouge_l is not None]
        out[kind] = {
            "ppl": _json_number(_pooled_ppl(members)),
            "rouge_l": _mean_or_none(rouge),
            "rouge_l_sem": _json_number(standard_error(rouge)) if rouge else None,
            "accuracy": _mean_or_none([s.accuracy for s in members if s.accuracy is not None]),
            "samples": len(members),
        }
    return out


def summarize(
    spec: PressSpec, budget: float, scores: Sequence[PromptScore], rows: Sequence[Row], seconds: float,
    quantized_as: Quantized | None = None, element_bytes: int = 4,
) -> dict[str, Any]:
    """One `results` entry of the JSON; with `quantized_as`, kv_fraction is a share of bytes."""
    if len(scores) != len(rows) or not scores:
        raise ValueError("need one score per row, at least one")
    rouge = [s.rouge_l if s.rouge_l is not None else math.nan for s in scores]
    accuracy = [s.accuracy for s in scores]
    answered = [a for a in accuracy if a is not None]
    full = sum(s.kv_full for s in scores)
    full_bytes = sum(s.kv_full_bytes for s in scores)
    byte_share = sum(s.kv_bytes for s in scores) / full_bytes if full_bytes else math.nan
    quantized = {}
    if quantized_as is not None:
        # kv_fraction is the share of the model's own cache's bytes, as kvtool eval reports a
        # quantized cache; kv_fraction_16bit the share of a 16-bit cache's bytes with quanto's
        # scales, zero points and full-precision residual at 16 bits too, as a 16-bit model stores
        # them (kvtool's own formats keep float32 scales in any model).
        full_16bit = full_bytes * 2 / element_bytes
        quantized = {
            "kv_format": quantized_as.name, "kv_fraction_entries": _json_number(sum(s.kv_kept for s in scores) / full if full else math.nan),
            "kv_fraction_16bit": _json_number(sum(s.kv_bytes_16bit for s in scores) / full_16bit if full_bytes else math.nan),
        }
    return {
        "method": spec.method,
        "press": spec.description,
        "budget": budget,
        "compression_ratio": compression_ratio(budget),
        "prompt_only": spec.prompt_only,
        "ppl": _json_number(_pooled_ppl(scores)),
        "tokens": sum(s.tokens for s in scores),
        "rouge_l": sum(rouge) / len(rouge),
        "rouge_l_sem": _json_number(standard_error(rouge)),
        "rouge_l_per_prompt": rouge,
        "accuracy": _mean_or_none(answered),
        "accuracy_per_prompt": accuracy,
        "kv_fraction": _json_number(byte_share if quantized_as is not None else sum(s.kv_kept for s in scores) / full if full else math.nan),
        "kv_fraction_physical": _json_number(sum(s.kv_physical for s in scores) / full if full else math.nan),
        **quantized,
        "kinds": _group(scores, rows),
        "outputs": [s.output for s in scores],
        "seconds": seconds,
        "seconds_per_prompt": seconds / len(scores),
    }


def summarize_full(scores: Sequence[PromptScore], rows: Sequence[Row]) -> dict[str, Any]:
    """The full cache's own figures (top level of the JSON)."""
    accuracy = [s.accuracy for s in scores]
    answered = [a for a in accuracy if a is not None]
    kinds = {
        kind: {key: value for key, value in figures.items() if key in ("ppl", "accuracy", "samples")}
        for kind, figures in _group(scores, rows).items()
    }
    return {
        "full_ppl": _json_number(_pooled_ppl(scores)),
        "reference_tokens": sum(s.tokens for s in scores),
        "full_accuracy": _mean_or_none(answered),
        "full_accuracy_per_prompt": accuracy,
        "full_kinds": kinds,
    }


# ---------------------------------------------------------------------------------------- the model


@dataclass
class Model:
    model: Any
    tokenizer: Any
    eos: set[int] = field(default_factory=set)


def load_model(model_dir: Path) -> Model:
    """float32, CPU, sdpa: as kvtool loads it (kvpress's AdaKV refuses eager attention anyway)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    # kvtool.models.loader.eos_token_ids: the generation config's EOS, else the tokenizer's.
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    eos = set() if configured is None else {int(t) for t in configured} if isinstance(configured, (list, tuple)) else {int(configured)}
    return Model(model=model, tokenizer=tokenizer, eos=eos)


# kvtool.models.prompts: the fallback for a tokenizer without a template that knows Gemma's turns
# (the Gemma 3 GGUF carries no template).
GEMMA_TURN = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    # kvtool.models.prompts.format_prompts: one user turn ending where the reply begins; the
    # rendered text already holds its special tokens.
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    elif all(t in tokenizer.get_vocab() for t in ("<start_of_turn>", "<end_of_turn>")):
        text = (tokenizer.bos_token or "") + GEMMA_TURN.format(prompt=prompt)
    else:
        raise PeerError("the tokenizer has no chat template (kvtool's plain fallback is not restated here)")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: str, max_tokens: int) -> list[int]:
    """kvtool.scoring.encoding.encode_prompt: chat-formatted ids, cut in the middle to max_tokens."""
    ids = _chat_ids(tokenizer, prompt)
    if len(ids) <= max_tokens:
        return ids
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    overhead = max(len(ids) - len(content), 0) + len(tokenizer(ELISION, add_special_tokens=False)["input_ids"])
    keep = max_tokens - overhead
    for _ in range(8):
        if keep < 2:
            break
        head = int(keep * HEAD_SHARE)
        text = tokenizer.decode(content[:head]) + ELISION + tokenizer.decode(content[len(content) - (keep - head) :])
        ids = _chat_ids(tokenizer, text)
        if len(ids) <= max_tokens:
            return ids
        keep -= len(ids) - max_tokens
    return ids[-max_tokens:]


def _step(model: Any, token: int, position: int, cache: Any) -> Any:
    import torch

    # position_ids carry the true position: the compressed cache is shorter than the tokens seen,
    # and transformers would otherwise number the new token by the cache's length.
    out = model(
        input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache, use_cache=True,
    )
    return out.logits[0, -1]


def _nll(logits: Any, token: int) -> float:
    import torch

    return -float(torch.log_softmax(logits.to(torch.float64), dim=-1)[token])


def prefill(model: Any, ids: Sequence[int], cache: Any) -> Any:
    import torch

    out = model(input_ids=torch.tensor([list(ids)]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def greedy(model: Any, cache: Any, first_logits: Any, prompt_len: int, length: int, eos: set[int]) -> tuple[list[int], float, int]:
    """Greedy tokens (the first EOS included), their NLL sum, and how many were fed to the cache."""
    tokens, nll, logits = [], 0.0, first_logits
    for t in range(length):
        token = int(logits.argmax())
        tokens.append(token)
        nll += _nll(logits, token)
        if token in eos or t == length - 1:
            break
        logits = _step(model, token, prompt_len + t, cache)
    return tokens, nll, len(tokens) - 1


def teacher_forced_nll(model: Any, cache: Any, first_logits: Any, prompt_len: int, reference: Sequence[int]) -> float:
    nll, logits = 0.0, first_logits
    for t, token in enumerate(reference):
        nll += _nll(logits, token)
        if t == len(reference) - 1:
            break
        logits = _step(model, token, prompt_len + t, cache)
    return nll


def kv_entries(model: Any, cache: Any) -> tuple[int, int]:
    """(effective, physical) KV entries, summed over layers and KV heads.

    AdaKV keeps pruned entries in the cache and masks them per head at attention time (kvpress's
    attention_patch: `masked_key_indices` on each attention module), so its memory does not shrink:
    the effective count leaves the masked entries out, the physical one does not.
    """
    effective = physical = 0
    for index, layer in enumerate(cache.layers):
        # A quantized layer holds its older entries quantized and its newest in `keys` (empty at first).
        held = [t for t in (layer.keys, getattr(layer, "_quantized_keys", None)) if t is not None and t.dim() == 4]
        stored = sum(int(t.shape[1] * t.shape[2]) for t in held)
        masked = getattr(model.model.layers[index].self_attn, "masked_key_indices", None)
        physical += stored
        effective += stored - (int(masked[0].numel()) if masked is not None else 0)
    return effective, physical


def tensor_bytes(t: Any, as_16bit: bool = False) -> int:
    """Bytes a tensor holds; a quanto tensor's are its codes' (packed), scales' and zero points'.
    `as_16bit`: floating-point values counted at 2 bytes, as a 16-bit model would store them."""
    parts = [getattr(t, name) for name in ("_data", "_scale", "_shift") if getattr(t, name, None) is not None]
    if not parts:
        return int(t.numel() * (2 if as_16bit and t.is_floating_point() else t.element_size()))
    return sum(tensor_bytes(p, as_16bit) for p in parts)


def kv_bytes(cache: Any, as_16bit: bool = False) -> int:
    """Bytes every layer's keys and values hold: the full-precision tensors and, in a quantized
    cache, the quantized ones."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += tensor_bytes(t, as_16bit)
    return total


def new_cache(config: Any, quantized: Quantized | None) -> Any:
    from transformers import DynamicCache, QuantizedCache

    if quantized is None:
        return DynamicCache(config=config)  # sliding-window layers store their window only
    return QuantizedCache(
        backend="quanto", config=config, nbits=quantized.bits, q_group_size=quantized.group, residual_length=quantized.residual,
    )


def _reset_decoding_state(press: Any) -> None:
    # A decoding press counts steps and buffers hidden states; both passes must start afresh.
    inner = getattr(press, "decoding_press", None)
    if inner is not None:
        inner.reset()


def run_prompt(
    m: Model, press: Any, ids: list[int], reference: Sequence[int], max_new_tokens: int, quantized: Quantized | None = None,
) -> tuple[float, list[int], tuple[int, int, int], tuple[int, int]]:
    """Compress the prompt with `press` (None: full cache), teacher-force `reference` through one copy
    of that cache and decode greedily from another. Returns (NLL sum, greedy tokens, KV entries, KV bytes
    as held and as a 16-bit model would hold them)."""
    import contextlib
    import copy

    cache = new_cache(m.model.config, quantized)
    with press(m.model) if press is not None else contextlib.nullcontext():
        first = prefill(m.model, ids, cache)
        greedy_cache = copy.deepcopy(cache) if quantized is None else None
        nll = teacher_forced_nll(m.model, cache, first, len(ids), reference)
        _reset_decoding_state(press)
        if greedy_cache is None:
            # quanto's tensors cannot be deep-copied: the prompt runs (and is compressed) again.
            greedy_cache = new_cache(m.model.config, quantized)
            first = prefill(m.model, ids, greedy_cache)
        tokens, _, fed = greedy(m.model, greedy_cache, first, len(ids), max_new_tokens, m.eos)
        _reset_decoding_state(press)
    effective, physical = kv_entries(m.model, greedy_cache)
    held = (kv_bytes(greedy_cache), kv_bytes(greedy_cache, as_16bit=True))
    return nll, tokens, (effective, physical, full_entries(m.model.config, len(ids) + fed)), held


def full_entries(config: Any, seen: int) -> int:
    """KV entries a full cache holds after `seen` tokens, each layer counted as transformers stores
    it (kvtool.profiles.whole_cache): a sliding-window layer keeps min(seen, window - 1)."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    per_layer = [min(seen, window - 1) if kind == "sliding_attention" and window else seen for kind in kinds]
    return config.num_key_value_heads * sum(per_layer)


def skip_sliding_layers(press: Any) -> Any:
    """`press`, leaving sliding-window layers whole. kvpress compresses only Gemma 3's global layers,
    but its skip (BasePress.__call__) is keyed to Gemma3ForConditionalGeneration; the text-only
    Gemma3ForCausalLM gets the same here. The hook is looked up on the instance when the press
    registers it, and an outer press (PrefillDecodingPress, AdaKVPress) dispatches to its inner ones
    from its own hook, so wrapping the outer hook covers them."""
    if press is None:
        return None
    hook = press.forward_hook

    def forward_hook(module: Any, input: Any, kwargs: dict, output: Any) -> Any:
        return output if getattr(module, "is_sliding", False) else hook(module, input, kwargs, output)

    press.forward_hook = forward_hook
    return press


def is_hybrid(config: Any) -> bool:
    return "sliding_attention" in (getattr(config, "layer_types", None) or ())


def _text(tokenizer: Any, tokens: Sequence[int]) -> str:
    # kvtool.evaluation.runner._texts
    return tokenizer.decode(list(tokens), skip_special_tokens=True).strip()


def _score(row: Row, output: str) -> float | None:
    return answer_accuracy(output, row.answers) if row.answers else None


def _check_press_fits(names: Sequence[str], encoded: Sequence[list[int]]) -> None:
    snap = [n for n in names if n.startswith("snapkv")]
    short = [i for i, ids in enumerate(encoded) if len(ids) <= SNAPKV_WINDOW]
    if snap and short:
        raise PeerError(
            f"snapkv needs prompts longer than its {SNAPKV_WINDOW}-token window; prompt {short[0] + 1} is "
            f"{len(encoded[short[0]])} tokens (leave snapkv out of --presses)"
        )


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(options: Options) -> dict[str, Any]:
    import importlib

    import torch
    import transformers

    # kvpress patches transformers' attention functions on import; only the presses need it.
    kvpress = importlib.import_module("kvpress") if any(n != "none" for n in options.presses) else None

    started = time.perf_counter()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    rows = load_rows(options.data, options.limit, options.kinds)
    given = load_references(options.references, len(rows)) if options.references is not None else None
    m = load_model(options.model_dir)
    encoded = [encode_prompt(m.tokenizer, row.prompt, options.max_prompt_tokens) for row in rows]
    _check_press_fits(options.presses, encoded)
    _say(f"{len(rows)} prompts ({min(map(len, encoded))}-{max(map(len, encoded))} tokens), {options.model_dir}")
    hybrid = is_hybrid(m.model.config)
    config = m.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_bytes = next(m.model.parameters()).element_size()
    if options.quantized is not None:
        _say(f"the presses' caches are stored as {options.quantized.name}; kv_fraction is a share of bytes")
    if hybrid:
        _say("sliding-window layers are left whole, as kvpress runs Gemma 3: budgets apply to the global layers")

    with torch.inference_mode():
        tick = time.perf_counter()
        references: list[Reference] = []
        full_scores = []
        for index, (row, ids) in enumerate(zip(rows, encoded)):
            if given is not None:
                reference = given[index]
                nll, _, _, _ = run_prompt(m, None, ids, reference.token_ids, 1)
            else:
                from transformers import DynamicCache

                cache = DynamicCache(config=m.model.config)
                first = prefill(m.model, ids, cache)
                tokens, nll, _ = greedy(m.model, cache, first, len(ids), options.max_new_tokens, m.eos)
                reference = Reference(text=_text(m.tokenizer, tokens), token_ids=tuple(tokens))
            references.append(reference)
            full_scores.append(PromptScore(nll, len(reference.token_ids), reference.text, None, _score(row, reference.text)))
        full_seconds = time.perf_counter() - tick
        full = summarize_full(full_scores, rows)
        _say(f"full cache: ppl {full['full_ppl']:.3f} ({full_seconds:.1f} s, {full_seconds / len(rows):.2f} s/prompt)")

        results = []
        for budget in options.budgets:
            for name in options.presses:
                spec = PRESSES[name]
                if name == "none" and budget != options.budgets[0]:
                    continue  # it ignores the budget: once is enough
                tick = time.perf_counter()
                scores = []
                try:
                    for row, ids, reference in zip(rows, encoded, references):
                        press = spec.build(kvpress, compression_ratio(budget))
                        if hybrid:
                            press = skip_sliding_layers(press)
                        nll, tokens, (kept, physical, entries), held = run_prompt(
                            m, press, ids, reference.token_ids, options.max_new_tokens, options.quantized,
                        )
                        output = _text(m.tokenizer, tokens)
                        scores.append(PromptScore(
                            nll, len(reference.token_ids), output, rouge_l_f1(output, reference.text), _score(row, output),
                            kept, physical, entries, held[0], entries * 2 * head_dim * element_bytes, held[1],
                        ))
                except Exception as exc:  # a press that does not run on this model is a row of the table, not the end
                    error = f"{type(exc).__name__}: {exc}"
                    results.append({"method": spec.method, "press": spec.description, "budget": budget, "error": error})
                    _say(f"{spec.method} budget {budget:g}: failed on this model ({error})")
                    continue
                seconds = time.perf_counter() - tick
                result = summarize(spec, 1.0 if name == "none" else budget, scores, rows, seconds, options.quantized, element_bytes)
                results.append(result)
                accuracy = "" if result["accuracy"] is None else f" accuracy {result['accuracy']:.3f}"
                _say(
                    f"{spec.method} budget {result['budget']:g}: ppl {result['ppl']:.3f} rouge-l {result['rouge_l']:.3f}{accuracy} "
                    f"kv {result['kv_fraction']:.3f} ({seconds:.1f} s, {seconds / len(rows):.2f} s/prompt)"
                )

    return {
        "tool": "kvpress",
        "kvpress_version": _version("kvpress"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_dir": str(options.model_dir),
        "data": str(options.data),
        "samples": len(rows),
        "max_new_tokens": options.max_new_tokens,
        "max_prompt_tokens": options.max_prompt_tokens,
        "references": f"full_outputs of {options.references}" if given is not None else "full-cache greedy (computed here)",
        "kv_format": options.quantized.name if options.quantized is not None else "native",
        "native_bytes": element_bytes,
        "prompt_tokens": [len(ids) for ids in encoded],
        **full,
        "full_outputs": [{"text": r.text, "token_ids": list(r.token_ids)} for r in references],
        "results": results,
        "seconds_full": full_seconds,
        "seconds": time.perf_counter() - started,
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        # Input files are checked before the model loads: a typo should not cost a minute.
        rows = load_rows(options.data, options.limit, options.kinds)
        if options.references is not None:
            load_references(options.references, len(rows))
        report = run(options)
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1, ensure_ascii=False)
    if options.json_out is not None:
        options.json_out.parent.mkdir(parents=True, exist_ok=True)
        options.json_out.write_text(text + "\n", encoding="utf-8")
        _say(f"wrote {options.json_out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
