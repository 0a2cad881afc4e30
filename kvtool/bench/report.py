"""The `kvtool bench` report: the `--json` object other tools read, and the rich table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.bench.measure import CACHES, COMPRESSED, FULL, LABELS, BenchResult, CacheStats
from kvtool.units import human_bytes

# Keys of each of "full", "compressed" and "ceiling" in the JSON object.
CACHE_KEYS = ("prefill_s", "decode_tok_s", "end_to_end_tok_s", "kv_bytes", "peak_memory_bytes",
             "prompt_peak_memory_bytes", "kv_slots")
RATIO_KEYS = ("decode_speedup", "decode_speedup_ceiling", "prefill_ratio", "kv_fraction")


def cache_dict(stats: CacheStats) -> dict[str, Any]:
    return {
        "prefill_s": stats.prefill_s,
        "decode_tok_s": stats.decode_tok_s,
        "end_to_end_tok_s": stats.end_to_end_tok_s,
        "kv_bytes": stats.kv_bytes,
        "peak_memory_bytes": stats.peak_memory_bytes,
        "prompt_peak_memory_bytes": stats.prompt_peak_memory_bytes,
        "kv_slots": list(stats.kv_slots),
        # Every measured run, in the order run: the spread behind each median.
        "runs": [
            {"prefill_s": run.prefill_s, "decode_tok_s": run.decode_tok_s, "end_to_end_tok_s": run.end_to_end_tok_s,
             "peak_memory_bytes": run.peak_memory_bytes, "prompt_peak_memory_bytes": run.prompt_peak_memory_bytes}
            for run in stats.runs
        ],
    }


def bench_dict(result: BenchResult, *, model: str, profile_note: str) -> dict[str, Any]:
    """The `--json` contract: keep these keys stable, scripts parse them."""
    config = result.config
    return {
        "model": model,
        "profile": profile_note,
        "budget": result.profile.budget,
        "prompt_tokens": config.prompt_tokens,
        "batch": config.batch,
        "new_tokens": config.new_tokens,
        "repeat": config.repeat,
        "torch_threads": result.torch_threads,
        "device": result.device,
        "dtype": result.dtype,
        "peak_memory_method": result.peak_memory_method,
        **{name: cache_dict(getattr(result, name)) for name in CACHES},
        "decode_speedup": result.decode_speedup,
        "decode_speedup_ceiling": result.decode_speedup_ceiling,
        "prefill_ratio": result.prefill_ratio,
        "kv_fraction": result.kv_fraction,
        **({"kv_fraction_by_type": result.kv_fraction_by_type} if result.kv_fraction_by_type else {}),
        "side_by_side": None if result.side_by_side is None else {
            "turn_steps": result.side_by_side.turn_steps,
            "decode_tok_s": {name: result.side_by_side.decode_tok_s(name) for name in CACHES},
            "turns_tok_s": {name: list(result.side_by_side.tok_s[name]) for name in CACHES},
            "decode_speedup": result.side_by_side.decode_speedup,
            "decode_speedup_ceiling": result.side_by_side.decode_speedup_ceiling,
            "prompt_tensor_peak_bytes": dict(result.side_by_side.prompt_tensor_peak),
        },
        "prompt_rows_at_once": result.prompt_rows_at_once,
        "prompt_blocks": None if result.prompt_blocks is None else {
            "chosen_elements": result.prompt_blocks.chosen,
            "seconds": {str(k): v for k, v in result.prompt_blocks.seconds.items()},
            "spread": result.prompt_blocks.spread,
        },
    }


def bench_table(result: BenchResult) -> Table:
    table = Table(title="median of the measured runs", title_justify="left")
    table.add_column("cache", style="bold", no_wrap=True)
    # Two-line headers keep the table within 80 columns.
    table.add_column("prompt\nphase s", justify="right")
    table.add_column("decode\ntok/s", justify="right")
    table.add_column("end-to-end\ntok/s", justify="right")
    table.add_column("KV at\nthe end", justify="right")
    table.add_column("peak in the\nprompt phase", justify="right")
    table.add_column("peak\nmemory", justify="right")
    for name in CACHES:
        stats: CacheStats = getattr(result, name)
        table.add_row(
            LABELS[name],
            f"{stats.prefill_s:.3f}",
            f"{stats.decode_tok_s:.1f}",
            f"{stats.end_to_end_tok_s:.1f}",
            human_bytes(stats.kv_bytes),
            human_bytes(stats.prompt_peak_memory_bytes),
            human_bytes(stats.peak_memory_bytes),
        )
    return table


def render(console: Console, result: BenchResult, *, model: str, source: str, profile_note: str) -> None:
    config = result.config
    console.print(Text(f"model {model}: {source}", style="dim"), soft_wrap=True)
    console.print(Text(f"KV cache: {profile_note}", style="dim"), soft_wrap=True)
    console.print(
        Text(
            f"{config.batch} x {config.prompt_tokens} prompt tokens, {config.new_tokens} decode steps, "
            f"{config.repeat} measured run(s) per cache after a warm-up; {result.device}, {result.dtype}, "
            f"{result.torch_threads} torch thread(s)",
            style="dim",
        ),
        soft_wrap=True,
    )
    console.print(bench_table(result))
    paired = result.side_by_side
    if paired is not None:
        share = paired.decode_speedup / paired.decode_speedup_ceiling if paired.decode_speedup_ceiling else 0.0
        tok_s = ", ".join(f"{LABELS[name]} {paired.decode_tok_s(name):.1f}" for name in CACHES)
        console.print(
            f"decode side by side (turns of {paired.turn_steps} steps; tok/s {tok_s}): kvtool "
            f"{paired.decode_speedup:.2f}x the full cache's tokens/s (ceiling {paired.decode_speedup_ceiling:.2f}x: "
            f"kvtool reaches {share:.0%} of it)"
        )
    share = result.decode_speedup / result.decode_speedup_ceiling if result.decode_speedup_ceiling else 0.0
    console.print(
        f"decode{' in the runs' if paired is not None else ''}: kvtool {result.decode_speedup:.2f}x the full "
        f"cache's tokens/s (ceiling {result.decode_speedup_ceiling:.2f}x: kvtool reaches {share:.0%} of it)"
    )
    console.print(f"prompt phase: kvtool takes {result.prefill_ratio:.2f}x the full cache's time")
    if paired is not None and paired.prompt_tensor_peak:
        peaks = paired.prompt_tensor_peak
        held = ", ".join(f"{LABELS[name]} {human_bytes(peaks[name])}" for name in CACHES)
        full = peaks[FULL]
        console.print(
            f"prompt phase, most tensor memory allocated at once (untimed runs; {held}): kvtool "
            f"{peaks[COMPRESSED] / full if full else 0.0:.2f}x the full cache's"
        )
    rows = result.prompt_rows_at_once
    if rows is not None and rows < config.batch:
        console.print(
            Text(
                f"kvtool's prompt phase ran {rows} rows at a time: its draft holds the prompt in this memory, "
                "beside the compressed cache",
                style="dim",
            ),
            soft_wrap=True,
        )
    blocks = result.prompt_blocks
    if blocks is not None:
        timed = ", ".join(f"2^{k.bit_length() - 1} {v * 1e3:.0f} ms" for k, v in blocks.seconds.items())
        console.print(
            Text(
                f"prompt kernel block: 2^{blocks.chosen.bit_length() - 1} score elements, the fastest on this machine "
                f"({timed}; slowest/fastest {blocks.spread:.2f}x)",
                style="dim",
            ),
            soft_wrap=True,
        )
    by_type = ", ".join(f"{kind.removesuffix('_attention')} layers {share:.1%}" for kind, share in result.kv_fraction_by_type.items())
    # A float32 model's share also against a 16-bit cache of the same entries (what GPUs serve).
    native = {"float32": 4, "float64": 8}.get(result.dtype, 2)
    sixteen = f"; {result.kv_fraction * native / 2:.1%} of a 16-bit one" if native > 2 else ""
    console.print(f"KV cache: kvtool holds {result.kv_fraction:.1%} of the full cache's bytes{sixteen}" + (f" ({by_type})" if by_type else ""))
    console.print(Text(f"peak memory: {result.peak_memory_method}", style="dim"), soft_wrap=True)
