#!/usr/bin/env bash
# Train one job for every optimizer x learning rate (x seed), then compare each optimizer at its own best lr:
# sweep.png (best-lr loss curves, final loss vs lr, memory, tokens/s), sweep.md and sweep.json in DUMP_FOLDER.
#   OPTIMIZERS   optimizer names (default: "AdamW AdamMini")
#   LRS          peak learning rates (default: "3e-4 1e-3 3e-3")
#   SEEDS        training.seed values (default: "0")
#   NGPU         processes per run (default: the GPUs present / PARALLEL, else 1)
#   PARALLEL     runs at once, each on GPUs of its own (PARALLEL x NGPU at most the GPUs present; default 1)
#   CONFIG_FILE  job config (default: ./train_configs/debug_model.toml)
#   DUMP_FOLDER  the sweep's folder (default: ./outputs/sweep); run the same command again to resume a sweep
#   LAST_K       final training loss = mean of the last k logged values (default: 10, or what the sweep recorded)
#   CONFIRM_SEEDS seeds on which each optimizer's best settings train again; the verdict reads only them
#   BASELINE     the optimizer the others are compared with (default: AdamW)
#   VARY_DATA_SEED  set (to anything) to give each run its seed as its data seed too
#   BUDGETS      token budgets, each its own run: tokens ("2e8 4e8") or multiples of 20 tokens per non-embedding
#                parameter ("1x 2x"); WARMUP_FRACTION: each budget's warmup share of its steps (docs/study-runs.md)
#   extra arguments go to every train.py run, e.g. scripts/compare_optimizers.sh --training.steps 200
# The sweep itself is python -m torchtitan.tools.sweep (--help for its options).
set -euo pipefail
cd "$(dirname "$0")/.."

exec python -m torchtitan.tools.sweep \
    --optimizers "${OPTIMIZERS:-AdamW AdamMini}" --lrs "${LRS:-3e-4 1e-3 3e-3}" --seeds "${SEEDS:-0}" \
    ${NGPU:+--nproc "$NGPU"} ${PARALLEL:+--parallel "$PARALLEL"} --config-file "${CONFIG_FILE:-./train_configs/debug_model.toml}" \
    ${LAST_K:+--last-k "$LAST_K"} ${CONFIRM_SEEDS:+--confirm-seeds "$CONFIRM_SEEDS"} ${BASELINE:+--baseline "$BASELINE"} ${VARY_DATA_SEED:+--vary-data-seed} \
    ${BUDGETS:+--budgets "$BUDGETS"} ${WARMUP_FRACTION:+--warmup-fraction "$WARMUP_FRACTION"} \
    --dump-folder "${DUMP_FOLDER:-./outputs/sweep}" -- "$@"
