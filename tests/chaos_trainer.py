"""A made-up trainer for the scheduler's chaos test: no model, no torch, and a ledger of its own.

Takes the sweep's options (``--job.dump_folder``, ``--training.steps``), resumes from the newest ``step-N``
checkpoint in its folder, and trains each further step in CHAOS_STEP_SECONDS: saves its checkpoint, logs its loss
(``metrics.jsonl``, as train.py does), and appends the step to ``$CHAOS_LEDGER/{run folder}.jsonl``, a ledger
outside the run's folder that the sweep never reads. On SIGTERM it finishes its step, saves it and exits 4, as
train.py does on a scheduler's signal, and leaves the exit record train.py leaves (``torchtitan.errors``' format,
which a test here holds it to). Every launch, step, stop and end goes into the ledger, so the test counts what
trained, not what the sweep says.

A chaos test launches it hundreds of times, so it starts as light as Python can: ``-I -S`` (no site-packages, no
environment), and it imports only ``os``, ``signal``, ``sys`` and ``time``: its few JSON lines, numbers and a fixed
message, are written as text (``json`` and ``re`` alone cost a start 8 ms).
"""

import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = f"{sys.executable} -I -S {os.path.join(HERE, 'chaos_trainer.py')}"  # a --launcher
EXIT_RECORD = "exit.json"  # torchtitan.errors.EXIT_RECORD
PREEMPTED_EXIT_CODE = 4  # torchtitan.errors.PREEMPTED_EXIT_CODE


def ledger_problems(ledger, steps: int) -> list[str]:
    """What the trainer's ledger says went wrong with one run: a step trained twice or never, an end missing or
    repeated, a launch after the end."""
    import json

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


def append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def write_exit_record(run_dir: str, code: int, message: str) -> None:
    """What ``torchtitan.errors.write_exit_record`` writes (``message``: plain text, no quotes or backslashes)."""
    path = os.path.join(run_dir, EXIT_RECORD)
    with open(f"{path}.tmp", "w") as f:
        f.write(f'{{"exit_code": {code}, "message": "{message}", "time": {time.time()!r}, "pid": {os.getpid()}}}\n')
    os.replace(f"{path}.tmp", path)


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
    resumed, pid = max(saved, default=0), os.getpid()
    append(ledger, f'{{"launch": {pid}, "from": {resumed}, "time": {time.time()!r}}}')
    logs = os.path.join(run_dir, "tb", f"{time.time_ns()}-{pid}")
    os.makedirs(logs)
    metrics = os.path.join(logs, "metrics.jsonl")
    for step in range(resumed + 1, steps + 1):
        time.sleep(float(os.environ.get("CHAOS_STEP_SECONDS", "0.05")))
        os.makedirs(os.path.join(checkpoints, f"step-{step}"), exist_ok=True)
        with open(os.path.join(checkpoints, f"step-{step}", ".metadata"), "w"):
            pass
        append(ledger, f'{{"step": {step}, "pid": {pid}}}')
        append(metrics, f'{{"step": {step}, "loss_metrics/global_avg_loss": {2.0 + 1.0 / step!r}}}')
        if stop and step < steps:
            append(ledger, f'{{"stopped": {step}, "pid": {pid}}}')
            write_exit_record(run_dir, PREEMPTED_EXIT_CODE, f"preempted: stopped on SIGTERM after step {step}")
            return PREEMPTED_EXIT_CODE
    append(ledger, f'{{"finished": {pid}, "time": {time.time()!r}}}')
    write_exit_record(run_dir, 0, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
