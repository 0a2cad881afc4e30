#!/usr/bin/env bash
# Build the virtual environment benchmarks/peer_kvpress.py runs in, and optionally run it.
#
#   benchmarks/peer_kvpress_setup.sh                  # build .venv-kvpress/ (once; later calls reuse it)
#   benchmarks/peer_kvpress_setup.sh run [ARGS...]    # build if needed, then run the script on smollm2
#
# Its own environment because kvpress 0.5.5 pins transformers < 5.3 (it gets 5.2.0 here) and kvtool
# needs a newer one. torch is pinned first, to the CPU build: an unpinned torch would come with
# gigabytes of CUDA libraries. kvpress then brings transformers, accelerate, peft, datasets and
# pandas (none of them pulls CUDA once torch is there); rouge-score is the ROUGE-L kvtool uses;
# optimum-quanto is the backend of transformers' QuantizedCache (`--quantized-cache`).
#
# It produces the kvpress rows of the README's quality table (docs/results.md, "Quality against the peers").
#
# `run` finds the model as kvtool converted it (`$KVTOOL_CACHE`, default ~/.cache/kvtool): run any
# kvtool command on smollm2 once first (e.g. `kvtool generate smollm2 "hi"`) if it is not there.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-kvpress"
python="${PYTHON:-python3}"

# find_spec, not import: importing kvpress loads torch and transformers (half a minute on a busy CPU).
installed='import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("kvpress", "rouge_score", "optimum.quanto")))'
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "$installed" 2>/dev/null; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.13.0
    "$venv/bin/pip" install --quiet kvpress==0.5.5 rouge-score optimum-quanto==0.2.7
    echo "built $venv: $("$venv/bin/python" -c 'import kvpress, transformers, torch; from importlib.metadata import version; print("kvpress", version("kvpress"), "transformers", transformers.__version__, "torch", torch.__version__)')" >&2
fi

if [[ "${1:-}" != "run" ]]; then
    exit 0
fi
shift
cache="${KVTOOL_CACHE:-$HOME/.cache/kvtool}"
shopt -s nullglob
dirs=("$cache"/gguf/SmolLM2-135M-Instruct.Q4_1-*/)
if (( ${#dirs[@]} == 0 )); then
    echo "error: no converted SmolLM2-135M-Instruct under $cache/gguf: run a kvtool command on smollm2 once (e.g. kvtool generate smollm2 \"hi\")" >&2
    exit 2
fi
exec "$venv/bin/python" "$root/benchmarks/peer_kvpress.py" --model-dir "${dirs[0]%/}" "$@"
