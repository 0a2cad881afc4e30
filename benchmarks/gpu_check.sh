#!/usr/bin/env bash
# The GPU check as one script (what a session with a lent GPU runs; about 7 minutes on an H100):
#   1. (SMOKE=1) a smoke run first: cuda_check's exactness checks and one small cell at
#      Llama-3.1-8B's shape; the script stops there if any of that failed;
#   2. the README's table, in this order: cuda_check's exactness checks (float64 tiny Llama: CUDA-graph
#      decode, generate through the graph, the draft's prompts held in host memory, twice); the prompt
#      kernels alone (Triton forward against the fused one, each with the column sums); one layer's
#      decode attention; the decode steps' profile (`--profile decode`: the full cache's, the graph's,
#      and the graph's kernels run eagerly; about a minute); the recipe's prompt phase by part at
#      8192 x 4 (`--parts`: where its 4-5x goes); both shapes with the full cache under both SDPA
#      choices, kvtool without a draft (also with the prompt pass's forward from torch's fused
#      kernel) and with its draft (held prompts in host memory, and on the GPU); `generate` full
#      against kvtool at 8192 x 4; then, while the time budget lasts, the largest batch at 32k of
#      kvtool (its prompt phase a row at a time, up to 32 rows) and of the full cache.
# Results go to $OUT (or ./gpu-out): smoke.json, gpu.json, gpu.md.
set -euo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"

if [ "${SMOKE:-0}" = 1 ]; then
    "$python" benchmarks/gpu_bench.py --shape llama3-8b --shapes 2048x4 --repeats 1 --no-capacity --no-kernels \
        --exactness --budget-s 120 --json "$out/smoke.json" | tee "$out/smoke.md"
    "$python" - "$out/smoke.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
bad = [k for k, v in report.get("exactness", {}).get("checks", {}).items() if not v]
bad += [f"{c['prompt_tokens']}x{c['batch']} {name}: {cell['note'][-600:]}" for c in report["cells"]
        for name, cell in c["cells"].items() if "Traceback" in cell.get("note", "") or not cell.get("runs")]
if bad or not report.get("exactness", {}).get("passed"):
    print("smoke run failed:", *bad, report.get("exactness", {}).get("error", ""), sep="\n")
    sys.exit(1)
EOF
fi
"$python" benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4,32768x2 --repeats 2 --exactness \
    --decode-attention --no-ceiling --profile decode --parts --capacity-caches kvtool-no-draft-by-row,full --capacity-max-batch 32 \
    --budget-s "${BUDGET_S:-330}" --json "$out/gpu.json" | tee "$out/gpu.md"
