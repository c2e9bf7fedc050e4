"""A stand-in for run_llama_train.sh in the sweep's tests: logs a made-up run in a second, no model, no torch.

Takes the options the sweep passes (``--optimizer.name``, ``--optimizer.lr``, ``--training.seed``,
``--job.dump_folder``, ``--training.steps``) and writes TensorBoard events where train.py would, with the trainer's
tags. The training loss is a smooth bowl lowest at lr 1e-3 (the square of the distance in log10 lr), the validation
loss (logged when FAKE_VALIDATION is set) one lowest at lr 1e-2, each seed adds 0.01 per seed number, and a weight
decay (``--optimizer.weight_decay``) 10 times the square of its distance from 0.1 (0.3 for Muon). FAKE_BOWL, a JSON
object ``{"centre": lr, "step_cost": c, "offsets": {run name: loss}}``, makes the training loss instead rise by c
per squared doubling of the lr away from the centre, and adds a run's offset (a lucky or unlucky run).
FAKE_SECONDS makes each run last that long; FAKE_RECORD makes it write ``fake_run.json`` into its folder
(the GPUs and processes the sweep gave it, when it started and ended). FAKE_SCALE, a JSON object, gives the runs
a known law across model sizes (``--model.flavor``): ``{"params": {flavor: N}, "reference": N0, "lr": lr0,
"lr_exponent": a, "speedup": s0, "speedup_exponent": b, "noise": sd, "baseline": "AdamW"}`` puts the best lr at
lr0 (N / N0)^a and makes every optimizer but the baseline learn s0 (N / N0)^b times as fast (its loss at step t is
the baseline's at step s t), each (optimizer, seed, size) off that by a factor exp(sd Z); optional keys:
"speedups" {optimizer: s0} gives an optimizer its own s0, "bends" {optimizer: [a, b]} gives an optimizer instead a
speedup that bends toward 1, 1 + a (N / N0)^b (off by the same factor), "salt" draws other factors (another made-up
study), and without --model.flavor every size is the reference. FAKE_OUTCOMES, a JSON
object from run name (``{Optimizer}_lr{lr}_seed{seed}``, or the whole run folder's name) to one of the behaviours
below, makes a run misbehave:
  "nan"   - logs a NaN loss from step 3 on and exits 0;
  "exit3" - logs two steps, prints an ``error: ... non-finite ...`` line and exits 3, as train.py's guard does;
  "exit1" - logs two steps and crashes;
  "exit2" - prints a one-line user error and exits 2;
  "hang"  - writes its pid to ``{dump}/fake.pid`` and sleeps until it is killed;
  "stop"  - logs two steps and stops as train.py does on a scheduler's signal (exit 4), having saved a checkpoint
            of step 2 when FAKE_CHECKPOINT is set.
Like train.py, it records how it ended in its folder's exit record (not for a crash); with NGPU above 1 it exits as
torchrun does, 1 for any failure.
"""

import json
import math
import os
import random
import sys
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from torchtitan.errors import write_exit_record
from torchtitan.study.plan import lr_label


def options(argv: list[str]) -> dict[str, str]:
    # The sweep always passes "--key value"; the last value of a key wins, as in train.py.
    return {argv[i][2:]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def as_launched(code: int) -> int:
    """The exit code the sweep sees: under torchrun (NGPU above 1) any worker's failure reads as 1."""
    return 1 if code != 0 and int(os.environ.get("NGPU", "1")) > 1 else code


def main() -> int:
    o = options(sys.argv[1:])
    optimizer, lr, seed = o["optimizer.name"], float(o["optimizer.lr"]), int(o["training.seed"])
    steps = int(o.get("training.steps", "6"))
    name = f"{optimizer}_lr{lr_label(lr)}_seed{seed}"
    dump = Path(o["job.dump_folder"])
    outcomes = json.loads(os.environ.get("FAKE_OUTCOMES", "{}"))
    behaviour = outcomes.get(dump.name, outcomes.get(name))
    started = time.time()
    if behaviour == "exit2":
        message = "error: training.steps is too large for this test; lower it"
        print(message, file=sys.stderr)
        write_exit_record(dump, 2, message)
        return as_launched(2)
    if behaviour == "hang":
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "fake.pid").write_text(str(os.getpid()))
        time.sleep(600)
        return 1
    # The pid keeps a retried run's folder apart from its first attempt's, even within one second.
    writer = EventFileWriter(str(dump / "tb" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}_{optimizer}"))

    def log(step: int, tag: str, value: float) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    best_lr, speed = 1e-3, 1.0
    scale = json.loads(os.environ.get("FAKE_SCALE") or "null")
    if scale is not None:
        flavor = o.get("model.flavor")
        ratio = scale["params"][flavor] / scale["reference"] if flavor else 1.0
        best_lr = scale["lr"] * ratio ** scale["lr_exponent"]
        if optimizer != scale["baseline"]:
            salt = f" {scale['salt']}" if "salt" in scale else ""
            noise = random.Random(f"{optimizer} {seed} {flavor}{salt}").gauss(0.0, scale["noise"])
            s0 = scale.get("speedups", {}).get(optimizer, scale["speedup"])
            speed = s0 * ratio ** scale["speedup_exponent"]
            if optimizer in scale.get("bends", {}):
                a, b = scale["bends"][optimizer]
                speed = 1.0 + a * ratio**b
            speed *= math.exp(noise)
    distance = (math.log10(lr) - math.log10(best_lr)) ** 2
    bowl = json.loads(os.environ.get("FAKE_BOWL") or "null")
    if bowl is not None:
        distance = bowl["step_cost"] * math.log2(lr / bowl["centre"]) ** 2
        distance += bowl.get("offsets", {}).get(dump.name, bowl.get("offsets", {}).get(name, 0.0))
    weight_decay = float(o.get("optimizer.weight_decay", "0.1"))
    weight_decay_distance = 10.0 * (weight_decay - (0.3 if optimizer == "Muon" else 0.1)) ** 2
    log(0, "optimizer/state_bytes", {"AdamMini": 1 << 20}.get(optimizer, 2 << 20))
    for step in range(1, steps + 1):
        if behaviour == "stop" and step == 3:
            writer.close()
            if os.environ.get("FAKE_CHECKPOINT"):
                folder = dump / "checkpoint" / optimizer / "step-2"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / ".metadata").write_text("")
            message = "preempted: stopped on SIGTERM after step 2"
            print(message, file=sys.stderr)
            write_exit_record(dump, 4, message)
            return as_launched(4)
        if behaviour in ("exit3", "exit1") and step == 3:
            writer.close()
            if behaviour == "exit3":
                message = f"error: the loss was non-finite at step {step}; lower optimizer.lr"
                print(message, file=sys.stderr)
                write_exit_record(dump, 3, message)
                return as_launched(3)
            raise RuntimeError("the fake trainer crashed")
        loss = 2.0 + distance + weight_decay_distance + 0.01 * seed + 4.0 / (speed * step)
        log(step, "loss_metrics/global_avg_loss", math.nan if behaviour == "nan" and step >= 3 else loss)
        log(step, "throughput/tps", 1000.0 + 100.0 * seed + (500.0 if optimizer == "AdamMini" else 0.0))
        log(step, "memory/rss(GiB)", 0.5 + 0.01 * step)
        if os.environ.get("FAKE_VALIDATION") and step % 2 == 0:
            log(step, "validation/loss", 3.0 + (math.log10(lr) + 2) ** 2 + 0.01 * seed + 2.0 / step)
    writer.close()
    time.sleep(float(os.environ.get("FAKE_SECONDS") or 0))
    if os.environ.get("FAKE_RECORD"):
        keys = ("CUDA_VISIBLE_DEVICES", "NGPU")
        record = {"start": started, "end": time.time(), **{k: os.environ.get(k) for k in keys}}
        (dump / "fake_run.json").write_text(json.dumps(record))
    write_exit_record(dump, 0, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
