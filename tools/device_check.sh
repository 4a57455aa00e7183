#!/usr/bin/env bash
# The accelerator check in one command, capped at 9 minutes (what it measured so far is kept:
# tools/device_check.py appends each result to the JSON-lines file as it goes).
# Usage: tools/device_check.sh [OUT_DIR] [device_check.py args...]   (see tools/device_check.md)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-.}}"
[ $# -gt 0 ] && shift
mkdir -p "$out_dir"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
timeout 540 "${PYTHON:-python3}" tools/device_check.py --out "$out_dir/device_check.jsonl" "$@"
