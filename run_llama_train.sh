#!/usr/bin/env bash
# Train Llama 3 with torchrun on this machine.
#   NGPU         processes to start (default: the number of GPUs, else 2 on a CPU-only machine)
#   CONFIG_FILE  job config (default: ./train_configs/debug_model.toml)
#   NNODES       nodes of the job (default 1); above 1, each node runs this script (srun), and torchrun meets the
#                others at RDZV_ENDPOINT (host:port of the first node) for job RDZV_ID
#   PYTHON       the interpreter to train with (default: python on PATH); the sweep passes its own
#   SOCKET_IFNAME  on several nodes, the network interface for NCCL and gloo (default: the one towards RDZV_ENDPOINT)
#   extra arguments go to train.py, e.g. ./run_llama_train.sh --optimizer.name AdamMini --training.steps 100
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
TORCHRUN=("$PYTHON" -m torch.distributed.run)  # torchrun of that interpreter, whatever PATH finds first

if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [ "$NGPU" -gt 0 ] || NGPU=2
fi
CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_model.toml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# After preflight passed: tells train.py that this job (world size, its arguments) was checked, so that its first
# rank does not run the layout check again (torchtitan/config/preflight.py, job_digest).
checked() {
    local n=$1
    shift
    TORCHTITAN_PREFLIGHT_CHECKED=$(printf '%s\0' "$n" --job.config_file "$CONFIG_FILE" "$@" | sha256sum | cut -d' ' -f1)
    export TORCHTITAN_PREFLIGHT_CHECKED
}

if [ "${NNODES:-1}" -gt 1 ]; then
    "$PYTHON" -m torchtitan.config.preflight --nproc $((NNODES * NGPU)) --job.config_file "$CONFIG_FILE" "$@"
    checked $((NNODES * NGPU)) "$@"
    . scripts/socket_interface.sh "${RDZV_ENDPOINT%:*}"  # NCCL's and gloo's sockets towards the first node
    exec "${TORCHRUN[@]}" --nnodes "$NNODES" --nproc_per_node "$NGPU" --rdzv_id "$RDZV_ID" --rdzv_backend c10d \
        --rdzv_endpoint "$RDZV_ENDPOINT" train.py --job.config_file "$CONFIG_FILE" "$@"
fi

if [ "$NGPU" -eq 1 ]; then
    # One process needs no launcher: train.py checks the job itself and reports a mistake as one line.
    exec "$PYTHON" train.py --job.config_file "$CONFIG_FILE" "$@"
fi

# Check the job once before starting workers, so a mistake is one line rather than a wall of launcher output.
"$PYTHON" -m torchtitan.config.preflight --nproc "$NGPU" --job.config_file "$CONFIG_FILE" "$@"
checked "$NGPU" "$@"

exec "${TORCHRUN[@]}" --standalone --nnodes=1 --nproc_per_node="$NGPU" train.py --job.config_file "$CONFIG_FILE" "$@"
