"""Run train.py as ``run_llama_train.sh`` does for one process, holding it after a step until it is asked to stop.

    python tests/hold_until_stopped.py MARKER ARGS...    (the job's config from CONFIG_FILE, as the launcher's)

Unless MARKER exists, the run creates it after its second step, prints ``HELD``, and waits there (at most 300 s)
until a stop signal has reached it; then it goes on as train.py does: it saves that step and exits. A test can
then signal a run at a step it knows, however fast or slow the machine; the run resumed (MARKER now there) is not
held again. Only time passes while it is held: the losses and the checkpoint are train.py's own.
"""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.preemption import Preemption  # noqa: E402

marker = Path(sys.argv[1])
asked = Preemption.requested
calls = 0


def held_requested(self, group, device):
    global calls
    calls += 1
    if calls == 2 and not marker.exists():
        marker.touch()
        print("HELD", flush=True)
        deadline = time.monotonic() + 300
        while self.received is None and time.monotonic() < deadline:
            time.sleep(0.05)
    return asked(self, group, device)


Preemption.requested = held_requested
os.chdir(ROOT)
config = os.environ.get("CONFIG_FILE", "train_configs/debug_model.toml")
sys.argv = ["train.py", "--job.config_file", config, *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
