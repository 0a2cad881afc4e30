"""`kvtool bench`: decode speed, prompt-phase cost and memory of a kvtool cache against the full cache.

    from kvtool.bench import BenchConfig, long_prompts, run_bench, bench_dict

    config = BenchConfig(prompt_tokens=4096, new_tokens=64, batch=4, repeat=3)
    ids = long_prompts(tokenizer, config.prompt_tokens, config.batch).to(model.device)
    result = run_bench(model, ids, profile, config)
    print(result.decode_speedup, result.kv_fraction)
"""

from kvtool.bench.config import BenchConfig
from kvtool.bench.measure import BenchResult, CacheStats, RunResult, run_bench, truncate_like
from kvtool.bench.prompts import long_prompts
from kvtool.bench.report import bench_dict, bench_table, render

__all__ = [
    "BenchConfig",
    "BenchResult",
    "CacheStats",
    "RunResult",
    "bench_dict",
    "bench_table",
    "long_prompts",
    "render",
    "run_bench",
    "truncate_like",
]
