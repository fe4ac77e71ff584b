#!/usr/bin/env bash
# The one GPU check, with its console output kept beside the summary it writes:
#   bash benchmarks/gpu_check.sh [OUT_DIR] [more benchmarks/gpu_check.py arguments]
# OUT_DIR (default gpu_check) receives gpu_check.json, gpu_check.md and gpu_check.log.
set -uo pipefail
out="${1:-gpu_check}"
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
python benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
