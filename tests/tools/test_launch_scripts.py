"""Multi-node launches put NCCL's and gloo's sockets on one network interface, the one towards the first node: a
host name that resolves to a loopback address or another NIC would hang gloo's groups (the checkpoint manager's)
at start-up. Both launch scripts are run here with stand-ins for ``ip``, ``srun`` and the Python interpreter."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tests.helpers import ROOT

HEAD = "10.1.2.3"


def stand_ins(tmp_path, route: str) -> dict[str, str]:
    """A PATH where ``ip route get`` answers ``route``, ``ip addr show to`` names eth3, ``srun`` runs its command
    here, and PYTHON records the interfaces it was started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "ip": f"""
            case "$*" in
              *"route get"*) echo "{route}" ;;
              *"addr show to"*) echo "2: eth3    inet {HEAD}/24 brd 10.1.2.255 scope global eth3" ;;
            esac""",
        "srun": f"""
            case "$*" in *"hostname --ip-address"*) echo {HEAD}; exit 0 ;; esac
            while [ "${{1#-}}" != "$1" ]; do shift; done
            exec "$@" """,
        "scontrol": "echo node1",
        "python-stand-in": f"""
            echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $*" >> {tmp_path}/started""",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + textwrap.dedent(body).strip() + "\n")
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHON": str(bin_dir / "python-stand-in")}


def launched_interfaces(tmp_path) -> list[str]:
    """NCCL's and gloo's interface of the launcher's own start (torch.distributed.run)."""
    (line,) = [line for line in (tmp_path / "started").read_text().splitlines() if "torch.distributed.run" in line]
    return line.split()[:2]


@pytest.mark.parametrize(
    "route, interface",
    [(f"{HEAD} dev ib0 src 10.1.2.9 uid 0", "ib0"), (f"local {HEAD} dev lo table local src {HEAD}", "eth3")],
    ids=["another node", "the first node"],
)
def test_the_slurm_job_sets_gloos_interface_as_it_sets_nccls(tmp_path, route, interface):
    env = {**stand_ins(tmp_path, route), "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    env["SLURM_JOB_ID"] = "7"
    subprocess.run(["bash", "multinode_trainer.slurm"], cwd=ROOT, env=env, check=True, timeout=60)
    assert launched_interfaces(tmp_path) == [interface, interface]


def test_run_llama_train_on_several_nodes_sets_both_interfaces_and_keeps_a_chosen_one(tmp_path):
    env = {**stand_ins(tmp_path, f"{HEAD} dev ib0 src 10.1.2.9"), "NNODES": "2", "NGPU": "8"}
    env.update(RDZV_ENDPOINT=f"{HEAD}:29500", RDZV_ID="job")
    subprocess.run(["bash", "run_llama_train.sh"], cwd=ROOT, env=env, check=True, timeout=60)
    assert launched_interfaces(tmp_path) == ["ib0", "ib0"]
    (tmp_path / "started").unlink()
    subprocess.run(
        ["bash", "run_llama_train.sh"], cwd=ROOT, env={**env, "SOCKET_IFNAME": "eth7"}, check=True, timeout=60
    )
    assert launched_interfaces(tmp_path) == ["eth7", "eth7"]
