"""A made-up trainer for the scheduler's chaos test: no model, no torch, and a ledger of its own.

Takes the sweep's options (``--job.dump_folder``, ``--training.steps``), resumes from the newest ``step-N``
checkpoint in its folder, and trains each further step in CHAOS_STEP_SECONDS: saves its checkpoint, logs its loss
(``metrics.jsonl``, as train.py does), and appends the step to ``$CHAOS_LEDGER/{run folder}.jsonl``, a ledger
outside the run's folder that the sweep never reads. On SIGTERM it finishes its step, saves it and exits 4, as
train.py does on a scheduler's signal. Every launch, step, stop and end goes into the ledger, so the test counts
what trained, not what the sweep says. It starts as light as Python can (``-S``: no site-packages, which it does not
need; no pathlib), since a chaos test launches it hundreds of times.
"""

import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # started as a launcher (python -S, without the editable install): the repository first
    sys.path.insert(0, os.path.dirname(HERE))
from torchtitan.errors import PREEMPTED_EXIT_CODE, write_exit_record  # noqa: E402

TRAINER = f"{sys.executable} -S {os.path.join(HERE, 'chaos_trainer.py')}"  # a --launcher


def ledger_problems(ledger, steps: int) -> list[str]:
    """What the trainer's ledger says went wrong with one run: a step trained twice or never, an end missing or
    repeated, a launch after the end."""
    if not ledger.exists():
        return [f"{ledger.stem}: never launched"]
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    trained = [e["step"] for e in entries if "step" in e]
    ends = [i for i, e in enumerate(entries) if "finished" in e]
    problems = []
    if trained != list(range(1, steps + 1)):
        problems.append(f"{ledger.stem}: trained steps {trained}")
    if len(ends) != 1 or ends[0] != len(entries) - 1:
        problems.append(f"{ledger.stem}: ended {len(ends)} time(s), then {entries[ends[0] + 1 :] if ends else []}")
    return problems


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    argv = sys.argv[1:]
    options = {argv[i][2:]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    run_dir, steps = options["job.dump_folder"], int(options.get("training.steps", "4"))
    ledger = os.path.join(os.environ["CHAOS_LEDGER"], f"{os.path.basename(run_dir)}.jsonl")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    checkpoints = os.path.join(run_dir, "checkpoint")
    names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
    saved = [
        int(name[5:])
        for name in names
        if name.startswith("step-") and os.path.isfile(os.path.join(checkpoints, name, ".metadata"))
    ]
    resumed = max(saved, default=0)
    append(ledger, {"launch": os.getpid(), "from": resumed, "time": time.time()})
    logs = os.path.join(run_dir, "tb", f"{time.time_ns()}-{os.getpid()}")
    os.makedirs(logs)
    metrics = os.path.join(logs, "metrics.jsonl")
    for step in range(resumed + 1, steps + 1):
        time.sleep(float(os.environ.get("CHAOS_STEP_SECONDS", "0.05")))
        os.makedirs(os.path.join(checkpoints, f"step-{step}"), exist_ok=True)
        with open(os.path.join(checkpoints, f"step-{step}", ".metadata"), "w"):
            pass
        append(ledger, {"step": step, "pid": os.getpid()})
        append(metrics, {"step": step, "loss_metrics/global_avg_loss": 2.0 + 1.0 / step})
        if stop and step < steps:
            append(ledger, {"stopped": step, "pid": os.getpid()})
            write_exit_record(run_dir, PREEMPTED_EXIT_CODE, f"preempted: stopped on SIGTERM after step {step}")
            return PREEMPTED_EXIT_CODE
    append(ledger, {"finished": os.getpid(), "time": time.time()})
    write_exit_record(run_dir, 0, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
