"""Restarts under ``torchrun --max-restarts``: the restarted group starts, and a killed worker costs only the steps
since the last checkpoint.

torchrun's workers share its agent's store, which outlives them; ``init_distributed`` scopes this attempt's keys so
that a restarted group never reads the addresses of the ranks that died (``torchtitan/distributed/utils.py``).
"""

from __future__ import annotations

import textwrap

from tests import processes
from tests.distributed import launch_env
from tests.helpers import ROOT, restartable_command

# Both ranks join, reduce a number, and rank 1 dies on the first attempt: torchrun starts the group again.
WORKER = textwrap.dedent(
    """
    import os, torch
    from torchtitan.distributed.collectives import all_reduce_scalar
    from torchtitan.distributed.utils import init_distributed

    device, rank, world_size = init_distributed(60)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    total = all_reduce_scalar(rank + 1, "sum", torch.distributed.group.WORLD, device)
    print(f"attempt {attempt} rank {rank} sum {total:g}", flush=True)
    if attempt == 0 and rank == 1:
        os._exit(3)
    torch.distributed.destroy_process_group()
    """
)


def test_a_group_restarted_by_torchrun_starts_again(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = launch_env(2, cpu=True, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = processes.run(restartable_command(str(script)), timeout=300, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"attempt {attempt} rank {rank} sum 3" in output, output[-4000:]
