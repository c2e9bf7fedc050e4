"""Run train.py (as torchrun's script) with one rank SIGKILLing itself once, so that torchrun restarts the group.

    torchrun --max-restarts 1 ... tests/kill_rank_once.py train.py ARGS...

On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), rank ``KILL_RANK`` (default 1) prints ``KILLED rank R at
step S`` and SIGKILLs itself right after the checkpoint manager's ``save`` of step ``KILL_AT_STEP`` returns; later
attempts run undisturbed.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.checkpoint.manager import CheckpointManager  # noqa: E402

_save = CheckpointManager.save


def save_then_die(self, curr_step: int, force: bool = False) -> None:
    _save(self, curr_step, force)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    chosen = self.rank == int(os.environ.get("KILL_RANK", "1")) and curr_step == int(os.environ["KILL_AT_STEP"])
    if first_attempt and chosen:
        print(f"KILLED rank {self.rank} at step {curr_step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


CheckpointManager.save = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
