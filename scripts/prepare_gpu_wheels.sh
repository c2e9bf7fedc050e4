#!/usr/bin/env bash
# Download the wheels of every package scripts/gpu_check.sh needs that a GPU machine without a package index lacks,
# for CPython 3.12 on manylinux x86_64, into .whl/ (git-ignored) at the repository root; prints their total size.
#
#   scripts/prepare_gpu_wheels.sh            # then carry .whl with the call and install it there (docs/gpu-check.md)
#
# The machine is taken to have torch (2.11 or later) and the packages of docs/gpu-check.md already; each wheel is
# fetched without its dependencies, so this list names every one that machine lacks. One version of each.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
    "torchao==0.17.0"      # the low-bit optimizers (AdamW8bit/4bit/Fp8, AdamMini8bit/4bit); built for torch 2.11
    "torchdata==0.11.0"    # train.py's StatefulDataLoader, and the test helpers
    "datasets==5.2.0"      # train.py's text data loader (load_dataset)
    "dill==0.4.1"          # datasets' dependencies that the machine lacks
    "multiprocess==0.70.19"
    "adam-mini==1.1.1"     # the reference Adam-mini in benchmarks/bench_optimizers.py and tests/optim/test_adam_mini.py
    "tomli-w==1.2.0"       # train.py's job_config.toml, each run's resolved config
)
LIMIT_BYTES=$((64 * 1024 * 1024))  # what travels with one device call, the working tree included
PLATFORMS=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$platform")
done
rm -rf .whl
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
ls -l .whl
echo "prepare_gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $((total / 1024)) KiB in .whl (limit $((LIMIT_BYTES / 1048576)) MiB per call)"
if (( total > LIMIT_BYTES )); then
    echo "error: the wheels exceed the $((LIMIT_BYTES / 1048576)) MiB that travels with a device call" >&2
    exit 1
fi
