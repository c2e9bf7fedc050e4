"""Run train.py, holding it after a step until it is asked to stop.

    python tests/hold_until_stopped.py MARKER ARGS...    (also as torchrun's script: every rank holds)

ARGS go to train.py, after ``--job.config_file $CONFIG_FILE`` when CONFIG_FILE is set (as ``run_llama_train.sh``
passes it: the script is also a launcher for the sweep).

Unless MARKER exists when the process starts, the run creates it in its second step, where the divergence guard asks
whether a stop signal came, prints ``HELD``, and waits there (at most 300 s) until a stop signal reaches one of its
ranks: the rank that gets it creates ``MARKER.released`` for the others, and all of them go on as train.py does,
stopping after that step. A test can then signal a run at a
step it knows, however fast or slow the machine; the run resumed (MARKER now there) is not held again. Only time
passes while it is held: the losses and the checkpoint are train.py's own.
"""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.training.preemption import Preemption  # noqa: E402

marker = Path(sys.argv[1])
released = marker.with_name(marker.name + ".released")
hold = not marker.exists()  # read at start: every rank of a first attempt holds, a resumed run does not
asked = Preemption.signalled
calls = 0


def held_signalled(self):
    global calls
    calls += 1
    if calls == 2 and hold:
        marker.touch()
        print("HELD", flush=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not released.exists():
            if self.received is not None:
                released.touch()  # the other ranks learn of the signal from the guard's all-reduce
                break
            time.sleep(0.05)
    return asked(self)


Preemption.signalled = held_signalled
os.chdir(ROOT)
config = ["--job.config_file", os.environ["CONFIG_FILE"]] if os.environ.get("CONFIG_FILE") else []
sys.argv = ["train.py", *config, *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
