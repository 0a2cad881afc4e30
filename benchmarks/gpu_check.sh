#!/usr/bin/env bash
# The GPU check as one script (about 5 minutes on an H100):
#   1. (SMOKE=1) a smoke run first: cuda_check's exactness checks and one small cell at
#      Llama-3.1-8B's shape; the script stops there if any of that failed;
#   2. 8192 x 4: cuda_check's exactness checks (float64 tiny Llama: CUDA-graph decode, generate
#      through the graph, the draft's prompts held in host memory, twice); the prompt kernels alone
#      (torch's fused forward against the Triton one, each with the column sums); the recipe's prompt
#      phase by part (`--parts`); the full cache under both SDPA choices, kvtool without a draft and
#      with its draft (held prompts in host memory, and on the GPU; and with its second round from the
#      first's predictions, `Draft.jacobi`), without a draft also with the eager decode step
#      instead of the fused one (kernels/triton_step.py, whose exactness check is in step 2) and with
#      the fused step's victim search in one program per row (`split_victim_search` off);
#   3. 32768 x 2: the same without the exactness checks, 2 repeats;
#   4. (MORE=1) the decode steps' profile, `generate` full against kvtool, and the largest batch at
#      32k of kvtool (its prompt phase a row at a time) and of the full cache (about 5 minutes more);
#   5. (HYBRID=1) a random-weight model of Gemma-3-12B's shape (40 sliding-window layers of 1024, 8 global)
#      at 8192 x 4: the full cache against kvtool's uniform 0.2 (windows of 205 entries, global layers at 0.2).
# Results go to $OUT (or ./gpu-out): smoke.json, gpu-8k.json/.md, gpu-32k.json/.md, more.json/.md,
# gpu-gemma3-12b-8k.json/.md.
# SHAPE=tiny runs steps 2-3 on a tiny random model (a CPU dry run of the script).
set -euo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
bench=("$python" benchmarks/gpu_bench.py --shape "${SHAPE:-llama3-8b}" --no-decode-attention --no-ceiling --no-capacity --no-generate)

if [ "${SMOKE:-0}" = 1 ]; then
    "$python" benchmarks/gpu_bench.py --shape llama3-8b --shapes 2048x4 --repeats 1 --no-capacity --no-kernels \
        --exactness --budget-s 120 --json "$out/smoke.json" | tee "$out/smoke.md"
    "$python" - "$out/smoke.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
bad = [k for k, v in report.get("exactness", {}).get("checks", {}).items() if not v]
bad += [f"{c['prompt_tokens']}x{c['batch']} {name}: {cell['note'][-600:]}" for c in report["cells"]
        for name, cell in c["cells"].items() if "Traceback" in cell.get("note", "") or not cell.get("runs")]
if bad or not report.get("exactness", {}).get("passed"):
    print("smoke run failed:", *bad, report.get("exactness", {}).get("error", ""), sep="\n")
    sys.exit(1)
PY
fi
"${bench[@]}" --shapes 8192x4 --repeats 3 --exactness --parts --budget-s "${BUDGET_8K_S:-190}" \
    --json "$out/gpu-8k.json" | tee "$out/gpu-8k.md"
"${bench[@]}" --shapes 32768x2 --repeats 2 --no-exactness --parts --budget-s "${BUDGET_32K_S:-210}" \
    --json "$out/gpu-32k.json" | tee "$out/gpu-32k.md"
if [ "${MORE:-0}" = 1 ]; then
    "$python" benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4 --repeats 1 --no-exactness --no-kernels \
        --no-decode-attention --no-ceiling --profile decode --generate --capacity-caches kvtool-no-draft-by-row,full \
        --capacity-max-batch 32 --budget-s 300 --json "$out/more.json" | tee "$out/more.md"
fi
if [ "${HYBRID:-0}" = 1 ]; then
    "$python" benchmarks/gpu_bench.py --shape gemma3-12b --shapes 8192x4 --repeats 2 --no-exactness --no-capacity \
        --no-kernels --no-decode-attention --no-generate --budget-s "${BUDGET_HYBRID_S:-170}" \
        --json "$out/gpu-gemma3-12b-8k.json" | tee "$out/gpu-gemma3-12b-8k.md"
fi
