#!/usr/bin/env bash
# Regenerate the calibrated profiles that ship inside the package (kvtool/profiles/builtin/),
# with the default calibration settings (10 shipped prompts, seed 0). `kvtool generate MODEL
# --budget B` picks these up by name: <model alias>-b<budget>.yaml.
#
#   scripts/build_builtin_profiles.sh            # uses .venv/bin/kvtool
#   KVTOOL=kvtool scripts/build_builtin_profiles.sh
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL="${KVTOOL:-.venv/bin/kvtool}"
OUT=kvtool/profiles/builtin

for budget in 0.2 0.5; do
    "$KVTOOL" calibrate smollm2 --budget "$budget" --out "$OUT/smollm2-b$budget.yaml"
done
