#!/usr/bin/env bash
# Pallas ragged paged attention on an NVIDIA GPU (H200): numerics vs reference, timing vs the
# xla backend, HBM GB/s vs measured copy bandwidth. Needs JAX with CUDA; fetches nothing.
# Usage: tools/device_check.sh [OUT_DIR]   (writes OUT_DIR/device_check.json; default: .)
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-.}}"
[ $# -gt 0 ] && shift
mkdir -p "$out_dir"
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 290 "$py" tools/device_check.py --json "$out_dir/device_check.json" "$@"
