#!/usr/bin/env bash
# The GPU check as one script (what a session with a lent GPU runs; about 8 minutes on an H100):
#   1. a smoke run: cuda_check's exactness checks (float64 tiny Llama, CUDA-graph decode included)
#      and one small cell at Llama-3.1-8B's shape; it stops here if any of that failed;
#   2. the README's table: both shapes, the full cache under both SDPA choices, the ceiling, kvtool
#      without and with its draft, and the largest batch of the full cache and of kvtool at 32k.
# Results go to $OUT (or ./gpu-out): smoke.json, gpu.json, gpu.md.
set -euo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"

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
"$python" benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4,32768x2 --repeats 2 --no-kernels --no-exactness \
    --capacity-caches full,kvtool-no-draft --budget-s "${BUDGET_S:-400}" --json "$out/gpu.json" | tee "$out/gpu.md"
