#!/usr/bin/env bash
# Every check that needs a GPU, in one call: scripts/gpu_check.sh --out DIR [--dry-run] [--only STEPS]
# [--optimizers NAMES]. Writes DIR/gpu_check.md and DIR/gpu_check.json; see torchtitan/tools/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then
        # The dry run stays on the CPU and eager, whatever the machine has.
        export CUDA_VISIBLE_DEVICES="" TORCHDYNAMO_DISABLE=1
    fi
done
exec python -m torchtitan.tools.gpu_check "$@"
