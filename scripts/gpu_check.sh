#!/usr/bin/env bash
# Every check that needs a GPU: scripts/gpu_check.sh --out DIR [--quick | --only STEPS_OR_GROUPS] [--dry-run]
# [--optimizers NAMES]. Writes DIR/gpu_check.md and DIR/gpu_check.json after every step; see docs/gpu-check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then
        # The dry run stays on the CPU and eager, whatever the machine has.
        export CUDA_VISIBLE_DEVICES="" TORCHDYNAMO_DISABLE=1
    fi
done
# python3: a machine may have no `python`. PYTHONPATH is extended, not replaced: wheels installed beside the
# project (scripts/prepare_gpu_wheels.sh) stay importable.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m torchtitan.tools.gpu_check "$@"
