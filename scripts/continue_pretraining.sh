#!/usr/bin/env bash
# Continued pretraining from a downloaded Hugging Face Llama folder: one run per optimizer, every run starting from
# the folder's weights with its tokenizer, then the runs compared (compare.png and a table in DUMP_FOLDER).
#   scripts/continue_pretraining.sh MODEL_FOLDER [train.py options]
#   MODEL_FOLDER  the Hugging Face folder: config.json, *.safetensors, tokenizer.json (e.g. Llama-3.2-1B)
#   FLAVOR        model.flavor of those weights (default: 3.2-1B)
#   OPTIMIZERS    optimizer names (default: "AdamW AdamMini")
#   DUMP_FOLDER   where the runs log (default: ./outputs/continued); each run adds a tb/{time}_{Optimizer} folder
#   NGPU, CONFIG_FILE  as for run_llama_train.sh (default config: ./train_configs/debug_model.toml)
#   extra arguments go to every run, e.g. --optimizer.lr 3e-5 --training.steps 1000 --training.dataset c4
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "usage: scripts/continue_pretraining.sh MODEL_FOLDER [train.py options] (MODEL_FOLDER: a Hugging Face Llama folder)" >&2
    exit 2
fi
MODEL_FOLDER=$1
shift
DUMP_FOLDER=${DUMP_FOLDER:-./outputs/continued}

for optimizer in ${OPTIMIZERS:-AdamW AdamMini}; do
    ./run_llama_train.sh --model.flavor "${FLAVOR:-3.2-1B}" --model.tokenizer_path "$MODEL_FOLDER" \
        --checkpoint.initial_load_path "$MODEL_FOLDER" --checkpoint.initial_load_in_hf \
        --optimizer.name "$optimizer" --job.dump_folder "$DUMP_FOLDER" "$@"
done
python -m torchtitan.tools.compare_runs "$DUMP_FOLDER/tb" --out "$DUMP_FOLDER/compare.png"
