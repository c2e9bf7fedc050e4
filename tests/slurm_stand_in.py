"""Stand-ins for Slurm's commands in the scheduler's fault-injection tests: ``sbatch``, ``squeue``, ``sacct``,
``scontrol`` and ``sinfo`` as one script, called by a wrapper of each name that sets ``STAND_IN_COMMAND``. Nothing
runs: a "controller" is a JSON file, ``$STAND_IN_SLURM/state.json``, holding the jobs
queued so far; ``$STAND_IN_SLURM/behaviour.json`` says how the next ``sbatch`` answers:

  {"sbatch": "ok"}                  - queues the array and prints its id (``--parsable``);
  {"sbatch": "timeout"}             - queues the array, then does not answer (sleeps past the caller's timeout);
  {"sbatch": "socket"}              - queues the array, then fails with "Socket timed out on send/recv operation"
                                      ("queue": false: fails so without queuing it);
  {"sbatch": "refuse", "error": E}  - queues nothing and fails with E;
  "squeue_user_jobs": N             - the user has N other jobs queued (what ``squeue -u`` counts);
  "max_array_size": N               - ``scontrol show config``'s MaxArraySize (default 1001);
  "hidden": true                    - squeue shows none of the jobs queued (a controller slow to list them);
  "squeue_failures": N              - the next N ``squeue -j`` calls fail as a busy controller's do.
``srun`` runs its command here (a job script can run on this machine), ``scontrol show hostnames`` says localhost,
``scontrol requeue`` and ``scancel`` do nothing but be recorded.

Every call is appended to ``$STAND_IN_SLURM/calls.jsonl`` (its name and arguments). Job states: every task of an
array stays PENDING unless ``state.json`` says otherwise (``"states": {"12_0": "RUNNING"}``).
"""

import json
import os
import re
import sys
import time
from pathlib import Path

FOLDER = Path(os.environ["STAND_IN_SLURM"])


def load(name: str, default):
    path = FOLDER / name
    return json.loads(path.read_text()) if path.exists() else default


def option(argv: list[str], *names: str):
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def script_option(script: str, name: str):
    for line in Path(script).read_text().splitlines():
        if line.startswith(f"#SBATCH {name}="):
            return line.split("=", 1)[1]
    return None


def sbatch(argv: list[str], state: dict, behaviour: dict) -> int:
    mode = behaviour.get("sbatch", "ok")
    if mode == "refuse":
        print(behaviour["error"], file=sys.stderr)
        return 1
    if mode == "socket" and behaviour.get("queue") is False:
        print("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    array = option(argv, "--array")
    last = int(re.match(r"0-(\d+)", array).group(1)) if array else 0
    script = argv[-1]
    name = option(argv, "--job-name", "-J") or script_option(script, "--job-name")
    job_id = str(state.get("next_id", 100))
    state["next_id"] = int(job_id) + 1
    state.setdefault("jobs", []).append(
        {"id": job_id, "name": name, "tasks": last + 1, "argv": argv, "dependency": option(argv, "--dependency")}
    )
    (FOLDER / "state.json").write_text(json.dumps(state))
    if mode == "timeout":
        time.sleep(600)
        return 1
    if mode == "socket":
        print("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    print(job_id)
    return 0


def squeue(argv: list[str], state: dict, behaviour: dict) -> int:
    if option(argv, "-u", "--user") is not None or "--me" in argv:
        for n in range(behaviour.get("squeue_user_jobs", 0)):
            print(f"{9000 + n}|PENDING|Priority")
        return 0
    if behaviour.get("hidden"):
        return 0
    if option(argv, "-j", "--jobs") and state.get("squeue_failed", 0) < behaviour.get("squeue_failures", 0):
        state["squeue_failed"] = state.get("squeue_failed", 0) + 1
        (FOLDER / "state.json").write_text(json.dumps(state))
        print("squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    name, ids = option(argv, "-n", "--name"), option(argv, "-j", "--jobs")
    wanted = set(ids.split(",")) if ids else None
    for job in state.get("jobs", []):
        if (name is not None and job["name"] != name) or (wanted is not None and job["id"] not in wanted):
            continue
        for task in range(job["tasks"]):
            task_id = f"{job['id']}_{task}"
            print(f"{task_id}|{state.get('states', {}).get(task_id, 'PENDING')}|None")
    return 0


def scontrol(argv: list[str], behaviour: dict) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("localhost")
        return 0
    if argv[:2] == ["show", "config"]:
        print(f"MaxArraySize            = {behaviour.get('max_array_size', 1001)}")
        print("MinJobAge               = 300 sec")
        return 0
    return 0


def main() -> int:
    command, argv = os.environ["STAND_IN_COMMAND"], sys.argv[1:]
    with open(FOLDER / "calls.jsonl", "a") as f:
        f.write(json.dumps([command, *argv]) + "\n")
    state, behaviour = load("state.json", {}), load("behaviour.json", {})
    if command == "sbatch":
        return sbatch(argv, state, behaviour)
    if command == "squeue":
        return squeue(argv, state, behaviour)
    if command == "scontrol":
        return scontrol(argv, behaviour)
    if command == "srun":  # runs its command here, as one task
        args = [a for a in argv if not a.startswith("--")]
        os.execvp(args[0], args)
    if command in ("scancel",):
        return 0
    if command == "sinfo":
        print("debug*|1:00:00|1|64|(null)")
        return 0
    if command == "sacct":
        print("Slurm accounting storage is disabled", file=sys.stderr)
        return 1
    print(f"{command}: not stood in for", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
