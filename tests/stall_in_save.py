"""Run a script whose checkpoint saves stall, so that a test can SIGKILL it in the middle of a save.

    python tests/stall_in_save.py SCRIPT ARGS...    (also as torchrun's script: every rank stalls)
    python tests/stall_in_save.py -c CODE

From save number ``STALL_AT_SAVE`` (default 1) of each process on, a save writes this rank's data files, prints
``STALLED rank R`` and sleeps, before DCP writes the metadata that would complete it.
"""

import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.checkpoint import manager as checkpoint  # noqa: E402  (where saves look up ChecksummingWriter)


class StallingWriter(checkpoint.ChecksummingWriter):
    saves = 0

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        StallingWriter.saves += 1
        if StallingWriter.saves >= int(os.environ.get("STALL_AT_SAVE", "1")):
            future.wait()
            print("STALLED rank", os.environ.get("RANK", "0"), flush=True)
            time.sleep(3600)
        return future


checkpoint.ChecksummingWriter = StallingWriter
if sys.argv[1] == "-c":
    exec(compile(sys.argv[2], "<stall_in_save -c>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
