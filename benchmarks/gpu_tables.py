"""The Markdown tables benchmarks/gpu_bench.py prints from its report (the JSON it writes with `--json`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # the gpu_* modules beside this one (not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cells import CAPACITY_CACHES  # noqa: E402
from gpu_kernels import SDPA_FWD_ALONE, SDPA_FWD_SUMS  # noqa: E402
from gpu_models import RECIPE  # noqa: E402
from gpu_timing import GIB  # noqa: E402


def fmt(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not stat:
        return "-"
    med, lo, hi = (stat[k] / scale for k in ("median", "min", "max"))
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def ratio(entry: dict[str, Any], key: str) -> str:
    value = entry.get("ratio_to_baseline", {}).get(key)
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}, {report['shape']} (random weights, {report['dtype']}), torch {report['torch']}, "
        f"transformers {report['transformers']}, triton {report.get('triton') or '-'}; kvtool cells: the shipped "
        f"{RECIPE[0]} b{RECIPE[1]:g} recipe's rules at budget {report['kv_budget']:g} in every layer; "
        f"{report['new_tokens']} new tokens; median (min-max) of {report['repeats']} runs; x: against the fastest "
        f"full cache for that column (SDPA choices compared; kvtool and the ceiling run under the fastest prompt phase's).",
        "",
        "| prompt x batch | cache | prompt phase, s | x | decode, tok/s | x | end-to-end, tok/s | x | KV, GiB | x | prompt-phase peak, GiB | x | peak, GiB | x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in report["cells"]:
        label = f"{cell['prompt_tokens']} x {cell['batch']}"
        for name, entry in cell["cells"].items():
            marks = sorted({label for key, label in (("prefill_s", "prompt"), ("decode_tok_s", "decode"), ("end_to_end_tok_s", "end to end"))
                            if cell.get("baselines", {}).get(key) == name})
            shown = f"{name} (baseline: {', '.join(marks)})" if marks else name
            if entry.get("note"):
                shown += f" [{entry['note'].splitlines()[-1][:60]}]"
            lines.append(
                f"| {label} | {shown} | {fmt(entry.get('prefill_s'), digits=3)} | {ratio(entry, 'prefill_s')} "
                f"| {fmt(entry.get('decode_tok_s'), digits=1)} | {ratio(entry, 'decode_tok_s')} "
                f"| {fmt(entry.get('end_to_end_tok_s'), digits=1)} | {ratio(entry, 'end_to_end_tok_s')} "
                f"| {fmt(entry.get('kv_bytes'), GIB)} | {ratio(entry, 'kv_bytes')} "
                f"| {fmt(entry.get('prompt_peak_memory_bytes'), GIB)} | {ratio(entry, 'prompt_peak_memory_bytes')} "
                f"| {fmt(entry.get('peak_memory_bytes'), GIB)} | {ratio(entry, 'peak_memory_bytes')} |"
            )
    parts = report.get("parts")
    if parts and "median" in parts:
        median, full = parts["median"], parts["median"]["full prompt forward"]
        lines += ["", f"The recipe's prompt phase by part at {parts['prompt_tokens']} x {parts['batch']} (draft {parts['draft']}; "
                  f"median of {len(parts['runs'])}; x: of the full cache's prompt forward):", "", "| part | s | x |", "| --- | --- | --- |"]
        lines += [f"| {name} | {seconds:.3f} | {seconds / full:.2f}x |" for name, seconds in median.items()]
    elif parts:
        lines += ["", f"prompt phase by part: {parts['error'].splitlines()[-1]}"]
    cap = report.get("capacity")
    if cap:
        lines += ["", f"Capacity at {cap['prompt_tokens']} prompt tokens, {cap['new_tokens']} new tokens:", "",
                  "| cache | largest batch | x | decode, tok/s | end-to-end, tok/s | x | peak, GiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
        base = cap.get("full", {})
        for name in [n for n in CAPACITY_CACHES if n in cap]:
            entry = cap.get(name, {})
            times = lambda key: (f"{entry[key] / base[key]:.2f}x" if entry.get(key) and base.get(key) else "-")  # noqa: E731
            run = entry.get("run") or {}
            note = entry.get("note") or (entry.get("error") or "").strip().splitlines()[-1:] or [""]
            note = note if isinstance(note, str) else note[0]
            lines.append(
                f"| {name} | {entry.get('batch', '-')} | {times('batch')} | {entry.get('decode_tok_s', float('nan')):.1f} "
                f"| {entry.get('end_to_end_tok_s', float('nan')):.1f} | {times('end_to_end_tok_s')} "
                f"| {run.get('peak_memory_bytes', float('nan')) / GIB:.1f} |"
                + (f" {note}" if note else "")
            )
    gen = report.get("generate")
    if gen and gen.get("cells"):
        lines += ["", f"`generate`, {gen['new_tokens']} greedy new tokens at {gen['prompt_tokens']} x {gen['batch']} "
                  "(wall time, prompt phase included):", "",
                  "| how | seconds | tok/s | x |", "| --- | --- | --- | --- |"]
        for name, entry in gen["cells"].items():
            sec = entry["seconds"]
            lines.append(f"| {name} | {sec['median']:.2f} ({sec['min']:.2f}-{sec['max']:.2f}) | {entry['tok_s']:.1f} "
                         f"| {entry['x']:.2f}x |" if entry.get("x") else f"| {name} | {sec['median']:.2f} | {entry['tok_s']:.1f} | - |")
    dec = report.get("decode_attention")
    if dec and dec.get("shapes"):
        lines += ["", f"Decode attention with scores alone, one layer (median of 20, CUDA events; mixed bmm available: "
                  f"{dec.get('mixed_bmm')}), against float64:", "",
                  "| prompt x batch | slots | path | ms | output max abs | probabilities max abs |", "| --- | --- | --- | --- | --- | --- |"]
        for key, cell in dec["shapes"].items():
            for name, entry in cell.items():
                if isinstance(entry, dict):
                    lines.append(f"| {key} | {cell['slots']} | {name} | {entry['ms']:.3f} | {entry['output_max_abs']:.2e} | {entry['probs_max_abs']:.2e} |")
    kern = report.get("kernels")
    if kern and kern.get("exactness_sdpa_forward"):
        ex = kern["exactness_sdpa_forward"]
        lines += ["", f"The sdpa forward with log-sum-exp and the column sums, against float64 at {ex['tokens']} unpadded tokens: "
                  f"output max abs {ex['output_max_abs']:.2e}, importance max rel {ex['importance_max_rel']:.2e}, "
                  f"heads max rel {ex['heads_max_rel']:.2e}, window max rel {ex['window_max_rel']:.2e}"]
    if kern and kern.get("one_layer_s"):
        ex = kern.get("exactness", {})
        lines += ["", "Prompt kernels alone, one layer (median of 10, CUDA events); against float64 at "
                  f"{ex.get('tokens')} tokens: output max abs {ex.get('output_max_abs', float('nan')):.2e}, "
                  f"importance max rel {ex.get('importance_max_rel', float('nan')):.2e}, "
                  f"window max rel {ex.get('window_max_rel', float('nan')):.2e}:", "",
                  "| prompt x batch | sdpa causal, ms | triton fwd + sums (heads, window), ms | x | importance only, ms | x "
                  "| sdpa fwd with log-sum-exp + sums (heads, window), ms | x | sdpa fwd with log-sum-exp alone, ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key, cell in kern["one_layer_s"].items():
            if "error" in cell:
                lines.append(f"| {key} | {cell['error'].splitlines()[-1]} | | | | | | | |")
                continue
            a, b, c = (cell[k] for k in ("sdpa causal (K/V repeated)", "triton fwd + column sums (heads, window 32)", "triton fwd + column sums (importance only)"))
            d, e = (cell.get(k, float("nan")) for k in (SDPA_FWD_SUMS, SDPA_FWD_ALONE))
            lines.append(f"| {key} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x | {c * 1e3:.2f} | {c / a:.2f}x | {d * 1e3:.2f} | {d / a:.2f}x | {e * 1e3:.2f} |")
    if kern and kern.get("sweep"):
        sw = kern["sweep"]
        show = lambda d: ", ".join(f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} failed" for k, v in d.items())  # noqa: E731
        lines += ["", f"Tile sweep at {sw['shape']} (both kernels, fwd_m x fwd_n / warps): {show(sw['forward_tiles_s'])}; "
                  f"column sums (sum_m x sum_n / warps) with the fastest forward: {show(sw['column_sum_tiles_s'])}"]
    if report.get("exactness"):
        ex = report["exactness"]
        state = "passed" if ex.get("passed") else "FAILED"
        lines += ["", f"cuda_check exactness: {state}" + (f" ({sum(ex['checks'].values())}/{len(ex['checks'])})" if ex.get("checks") else "")]
    if report["skipped"]:
        lines += ["", "Skipped for the time budget: " + "; ".join(report["skipped"])]
    return "\n".join(lines)
