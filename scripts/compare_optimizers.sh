#!/usr/bin/env bash
# Train one job once per optimizer, then compare the runs (loss curves, tokens/s, memory, optimizer state).
#   OPTIMIZERS   space-separated optimizer names (default: "AdamW AdamMini")
#   CONFIG_FILE  job config (default: ./train_configs/debug_model.toml)
#   NGPU         processes per run, as for run_llama_train.sh
#   DUMP_FOLDER  where the runs and the comparison go (default: ./outputs/compare_<date-time>)
#   extra arguments go to every train.py run, e.g. scripts/compare_optimizers.sh --training.steps 200
set -euo pipefail
cd "$(dirname "$0")/.."

OPTIMIZERS=${OPTIMIZERS:-"AdamW AdamMini"}
DUMP_FOLDER=${DUMP_FOLDER:-./outputs/compare_$(date +%Y%m%d-%H%M%S)}

for optimizer in $OPTIMIZERS; do
    echo "=== training with $optimizer"
    ./run_llama_train.sh --job.dump_folder "$DUMP_FOLDER" --metrics.enable_tensorboard true \
        --optimizer.name "$optimizer" "$@"
done

# Each run wrote its own TensorBoard folder under $DUMP_FOLDER/tb (or metrics.save_tb_folder); compare them all.
python -m torchtitan.tools.compare_runs "$DUMP_FOLDER" --out "$DUMP_FOLDER/compare.png" \
    --json "$DUMP_FOLDER/compare.json"
