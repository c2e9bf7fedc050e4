"""A stand-in Slurm controller that runs job scripts, for the scheduler's chaos test (tests/study/test_slurm_chaos.py).

Written from Slurm's documented behaviour (the sbatch, squeue, sacct, scancel and scontrol manuals), not from the
code under test: a :class:`Controller` thread in the test's process plays slurmctld and slurmd on one node, and
answers ``sbatch``, ``squeue``, ``sacct``, ``scancel``, ``scontrol`` and ``sinfo`` on a socket of its own; the
commands on PATH (:func:`install`) are a few lines of bash that send it their arguments, as Slurm's commands are
clients of slurmctld. Its state is one JSON file, ``state.json`` in its folder, read and written under an flock.

What it does as Slurm does:

- ``sbatch --array=0-N%K [--dependency=afterany:A[:B]] SCRIPT``: an array of N + 1 tasks, at most K running at once,
  none before every array it depends on has no task pending or running; the job name from the script's
  ``#SBATCH --job-name``. The array's id is its first task's own job id; each other task gets the next ids.
- Each task runs ``bash SCRIPT`` in a session of its own with ``SLURM_JOB_ID`` (its own id),
  ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``, ``SLURM_JOB_NAME``, ``SLURM_RESTART_COUNT`` and its output
  appended to the script's ``--output`` (``%A``, ``%a``, ``%%`` filled in).
- ``--signal=B:USR1@T`` ahead of a time limit: USR1 to the batch shell only, then, ``grace`` seconds later, the
  job is killed (SIGKILL to everything) and ends TIMEOUT.
- A preemption (PreemptMode=REQUEUE): SIGTERM to every process of the job, SIGKILL after ``grace``; then the job
  is requeued by Slurm itself (pending again, its restart count one higher, eligible after ``requeue_delay``).
- ``scancel ID`` (a user's cancel): SIGTERM to every process, SIGKILL after ``grace``; the job ends CANCELLED and
  stays so. ``scancel --signal=SIG ID``: SIG to the job's steps (``srun``'s processes) only, refused with "Job can
  not be altered now" at the rate ``not_alterable`` (Slurm 22.05, an array with pending tasks).
- ``scontrol requeue ID``: the job (running: once its processes ended) is pending again, restart count one higher.
- An ID is an array (every task), ``A_i`` (one task) or a task's own job id, as Slurm reads them.
- ``squeue``: a job while pending or running and for ``min_job_age`` seconds after it ended, then forgotten;
  ``-n`` and ``--name`` take a comma-separated list of names. ``sacct``: every job ever, with its state; a
  "runaway" keeps RUNNING there after it ended.

Faults, drawn from a seeded ``random.Random`` per schedule (``faults.json``): sbatch answers lost after queuing
(a socket error, or no answer within the caller's timeout), sbatch refusing for now, arrays listed late, squeue
and sacct failing for a while, runaways, MaxArraySize, preemptions, warnings ahead of a time limit, users' cancels.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import random
import re
import shlex
import signal
import socketserver
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ALIVE = ("PENDING", "RUNNING")
COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "scontrol", "sinfo")


@contextmanager
def locked_state(folder: Path):
    """The controller's state, read and written back under its lock."""
    with open(folder / "state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / "state.json"
        text = path.read_text() if path.exists() else json.dumps({"next_id": 100, "arrays": {}, "tasks": {}})
        state = json.loads(text)
        yield state
        changed = json.dumps(state)
        if changed != text:
            path.write_text(changed)


def install(folder: Path) -> str:
    """The stand-in commands in ``folder/bin``; the PATH to use. Each is a few lines of bash, a client of the
    controller's socket (its port in ``folder/port``), as Slurm's commands are clients of slurmctld: it sends its
    name and arguments and runs what comes back (print the output, print the errors, exit with the code), so that
    no call starts an interpreter. ``srun`` and ``scontrol show hostnames``, which every task calls, are shell."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        body = (
            f'read -r port < "{folder}/port" && exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1\n'
            f'printf \'%s\\0\' "$#" {name} "$@" >&3\n'
            "IFS= read -r -d '' answer <&3\n"
            'eval "$answer"\n'
        )
        if name == "scontrol":
            body = f'[ "$1 $2" = "show hostnames" ] && {{ echo localhost; exit 0; }}\n{body}'
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
    # srun: the step, in its own process group, its pid where scancel --signal finds it.
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        'while [ "${1#--}" != "$1" ]; do shift; done\n'
        f'echo $$ > "{folder}/steps/${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"\n'
        'exec "$@"\n'
    )
    (folder / "steps").mkdir(exist_ok=True)
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"


class _Commands(socketserver.ThreadingTCPServer):
    """The controller's socket: one thread per call (an sbatch that does not answer holds only its own)."""

    daemon_threads = True

    def __init__(self, controller: "Controller"):
        super().__init__(("127.0.0.1", 0), _Call)
        self.controller = controller

    def handle_error(self, request, client_address) -> None:
        """A caller that stopped waiting (its timeout) closed its end: nothing to answer. Anything else is the
        stand-in's own bug, which the test sees in settle()."""
        error = sys.exc_info()[1]
        if not isinstance(error, (BrokenPipeError, ConnectionResetError)):
            self.controller.error = error


class _Call(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data = b""
        while True:
            fields = data.split(b"\0")
            if len(fields) > 1 and len(fields) - 1 >= int(fields[0]) + 2:  # the count, the command, its arguments
                break
            chunk = self.request.recv(65536)
            if not chunk:
                return
            data += chunk
        command, argv = fields[1].decode(), [f.decode() for f in fields[2 : int(fields[0]) + 2]]
        code, out, err = run_command(self.server.controller.folder, command, argv)
        answer = f"printf %s {shlex.quote(out)}; printf %s {shlex.quote(err)} >&2; exit {code}"
        self.request.sendall(answer.encode())


class Controller:
    """slurmctld and slurmd on one node of ``capacity`` task slots, as a thread; ``faults`` its misbehaviour."""

    def __init__(self, folder: Path, faults: dict, seed: int, capacity: int = 12):
        self.folder = folder
        self.faults = faults
        self.random = random.Random(seed)
        self.capacity = capacity
        self.processes: dict[str, subprocess.Popen] = {}
        self.plans: dict[str, dict] = {}  # per running task: its fault and when
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.error: BaseException | None = None
        (folder / "faults.json").write_text(json.dumps(faults))
        self.commands = _Commands(self)
        self.commands_thread = threading.Thread(target=self.commands.serve_forever, args=(0.05,), daemon=True)
        (folder / "port").write_text(f"{self.commands.server_address[1]}\n")

    def __enter__(self) -> "Controller":
        self.thread.start()
        self.commands_thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the controller, its socket, and every task still running with it."""
        self.stop_event.set()
        self.thread.join(timeout=30)
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        self.commands.shutdown()
        self.commands.server_close()

    def busy(self) -> bool:
        """Whether a task runs, or one pending could start (now or after its requeue delay)."""
        with locked_state(self.folder) as state:
            return any(
                t["state"] == "RUNNING" or self._startable(state, t, ignore_time=True) for t in state["tasks"].values()
            )

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until nothing runs and nothing pending can start."""
        deadline = time.monotonic() + timeout
        while self.busy():
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise AssertionError(f"the controller did not settle within {timeout} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self.stop_event.is_set():
                with locked_state(self.folder) as state:
                    self._tick(state)
                time.sleep(0.02)
        except BaseException as error:  # the test sees it in settle()
            self.error = error

    def _startable(self, state: dict, task: dict, ignore_time: bool = False) -> bool:
        if task["state"] != "PENDING" or (not ignore_time and task["eligible"] > time.time()):
            return False
        array = state["arrays"][task["array"]]
        tasks = [t for t in state["tasks"].values() if t["array"] == task["array"]]
        if sum(t["state"] == "RUNNING" for t in tasks) >= array["limit"]:
            return False
        for after in array["after"]:  # afterany: every task of it has ended
            if any(t["array"] == after and t["state"] in ALIVE for t in state["tasks"].values()):
                return False
        return True

    def _tick(self, state: dict) -> None:
        now = time.time()
        for key, task in state["tasks"].items():
            if task["state"] == "RUNNING":
                self._running(state, key, task, now)
        running = sum(t["state"] == "RUNNING" for t in state["tasks"].values())
        for key, task in sorted(state["tasks"].items(), key=lambda kv: (int(kv[1]["array"]), kv[1]["index"])):
            if running >= self.capacity:
                break
            if self._startable(state, task):
                self._start(state, key, task, now)
                running += 1

    def _start(self, state: dict, key: str, task: dict, now: float) -> None:
        array = state["arrays"][task["array"]]
        output = array["output"].replace("%A", task["array"]).replace("%a", str(task["index"]))
        output = output.replace("%%", "%")
        environment = {
            **os.environ,
            "SLURM_JOB_ID": str(task["job_id"]),
            "SLURM_ARRAY_JOB_ID": task["array"],
            "SLURM_ARRAY_TASK_ID": str(task["index"]),
            "SLURM_JOB_NAME": array["name"],
            "SLURM_RESTART_COUNT": str(task["restarts"]),
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_NNODES": "1",
        }
        with open(output, "a") as out:
            process = subprocess.Popen(
                ["bash", array["script"]], env=environment, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=str(Path(array["script"]).parent),
            )  # fmt: skip
        self.processes[key] = process
        task.update(state="RUNNING", started=now, requeue=False, cancelled=False, preempted=False, timed_out=False)
        plan = {"fault": None}
        draw = self.random.random()
        for fault in ("preempt", "warn", "cancel"):
            rate = self.faults.get(fault, 0.0)
            if draw < rate:
                plan = {"fault": fault, "at": now + self.random.uniform(0.0, self.faults.get("fault_window", 0.5))}
                break
            draw -= rate
        self.plans[key] = plan

    def _signal_job(self, key: str, sig: int) -> None:
        try:
            os.killpg(self.processes[key].pid, sig)
        except ProcessLookupError:
            pass

    def _running(self, state: dict, key: str, task: dict, now: float) -> None:
        process, plan = self.processes[key], self.plans[key]
        grace = self.faults.get("grace", 3.0)
        if plan["fault"] is not None and "done" not in plan and now >= plan["at"]:
            plan["done"] = now
            if plan["fault"] == "warn":  # --signal=B:USR1: the batch shell only
                try:
                    os.kill(process.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            else:
                task["preempted" if plan["fault"] == "preempt" else "cancelled"] = True
                self._signal_job(key, signal.SIGTERM)
        if task.get("cancel_requested"):  # scancel ID by a user
            task["cancel_requested"] = False
            task["cancelled"] = True
            plan.setdefault("done", now)
            self._signal_job(key, signal.SIGTERM)
        if "done" in plan and now > plan["done"] + grace and process.poll() is None:
            if plan["fault"] == "warn":
                task["timed_out"] = True
            self._signal_job(key, signal.SIGKILL)
        code = process.poll()
        if code is None:
            return
        # The batch shell has ended: whatever it left in its session ends with it, as Slurm's cgroup does.
        self._signal_job(key, signal.SIGKILL)
        task.update(ended=now, exit_code=code)
        if task["requeue"] or task["preempted"]:
            task.update(
                state="PENDING", restarts=task["restarts"] + 1, eligible=now + self.faults.get("requeue_delay", 0.2)
            )
        elif task["cancelled"]:
            task["state"] = "CANCELLED"
        elif task["timed_out"]:
            task["state"] = "TIMEOUT"
        else:
            task["state"] = "COMPLETED" if code == 0 else "FAILED"
        if task["state"] != "PENDING" and self.random.random() < self.faults.get("runaway", 0.0):
            task["runaway"] = True  # accounting keeps it RUNNING


# ----------------------------------------------------------------------------------------------------------------
# The commands


def _option(argv: list[str], *names: str):
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def _script_option(script: str, name: str):
    for line in Path(script).read_text().splitlines():
        if line.startswith(f"#SBATCH {name}="):
            value = line.split("=", 1)[1]
            return value[1:-1].replace("'\"'\"'", "'") if value.startswith("'") else value
    return None


def _draw(folder: Path, faults: dict, name: str, call: Call) -> bool:
    """Whether this call of ``name`` fails: within a failing spell (``{name}_fail`` is its chance to start one,
    lasting ``{name}_spell`` calls)."""
    with locked_state(folder) as state:
        left = state.setdefault("spells", {}).get(name, 0)
        if left > 0:
            state["spells"][name] = left - 1
            return True
        if call.random.random() < faults.get(f"{name}_fail", 0.0):
            state["spells"][name] = faults.get(f"{name}_spell", 2) - 1
            return True
    return False


def _visible(array: dict) -> bool:
    return time.time() >= array["visible_at"]


def _tasks_of(state: dict, ident: str) -> list[str]:
    """The task keys an ID names: an array (all its tasks), A_i, or a task's own job id."""
    if "_" in ident:
        return [ident] if ident in state["tasks"] else []
    if ident in state["arrays"]:
        return [k for k, t in state["tasks"].items() if t["array"] == ident]
    return [k for k, t in state["tasks"].items() if str(t["job_id"]) == ident]


def sbatch(folder: Path, argv: list[str], faults: dict, call: Call) -> int:
    modes = faults.get("sbatch_modes", [])
    count_path = folder / "sbatch.count"
    count = int(count_path.read_text()) if count_path.exists() else 0
    count_path.write_text(str(count + 1))
    mode = modes[count] if count < len(modes) else "ok"
    if mode == "busy":
        print("sbatch: error: Batch job submission failed: Resource temporarily unavailable", file=call.err)
        return 1
    if mode == "unqueued":
        print("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", file=call.err)
        return 1
    spec = re.fullmatch(r"0-(\d+)(?:%(\d+))?", _option(argv, "--array") or "0-0")
    tasks, limit = int(spec.group(1)) + 1, int(spec.group(2) or 10**6)
    if tasks > faults.get("max_array_size", 1001):
        print("sbatch: error: Batch job submission failed: Invalid job array specification", file=call.err)
        return 1
    dependency = _option(argv, "--dependency") or ""
    script = argv[-1]
    with locked_state(folder) as state:
        after = dependency.split(":")[1:] if dependency.startswith("afterany:") else []
        if any(a not in state["arrays"] for a in after):
            print("sbatch: error: Batch job submission failed: Job dependency problem", file=call.err)
            return 1
        array = str(state["next_id"])
        state["next_id"] += tasks
        now = time.time()
        late = faults.get("late", 0.0) if call.random.random() < faults.get("late_rate", 0.0) else 0.0
        state["arrays"][array] = {
            "name": _script_option(script, "--job-name"),
            "script": script,
            "output": _script_option(script, "--output"),
            "limit": limit,
            "after": after,
            "visible_at": now + late,
        }
        for index in range(tasks):
            state["tasks"][f"{array}_{index}"] = {
                "array": array, "index": index, "job_id": int(array) + index, "state": "PENDING", "restarts": 0,
                "eligible": now, "ended": None,
            }  # fmt: skip
    if mode == "lost":
        print("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", file=call.err)
        return 1
    if mode == "timeout":
        time.sleep(faults.get("sbatch_timeout", 5.0))
    print(array, file=call.out)
    return 0


def squeue(folder: Path, argv: list[str], faults: dict, call: Call) -> int:
    if _draw(folder, faults, "squeue", call):
        print("squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation", file=call.err)
        return 1
    fmt = _option(argv, "-o", "--format") or "%i|%T|%r"
    names = _option(argv, "-n", "--name")
    ids = _option(argv, "-j", "--jobs")
    me = "--me" in argv or _option(argv, "-u", "--user") is not None
    with locked_state(folder) as state:
        lines = []
        for key, task in _listed(state, names, ids, by_task=True):
            if task["state"] not in ALIVE and time.time() - task["ended"] > faults.get("min_job_age", 1.0):
                continue  # forgotten by the controller
            if me and task["state"] not in ALIVE:
                continue
            reason = "None" if task["state"] != "PENDING" else "JobArrayTaskLimit"
            lines.append(fmt.replace("%i", key).replace("%T", task["state"]).replace("%r", reason))
    print("\n".join(lines), file=call.out)
    return 0


def _listed(state: dict, names, ids, by_task: bool):
    """The tasks a listing shows: of arrays the controller shows, named by ``-n`` and ``-j`` where given (``-j``
    naming arrays, and for squeue also single tasks)."""
    for key, task in sorted(state["tasks"].items()):
        array = state["arrays"][task["array"]]
        if not _visible(array):
            continue
        if names is not None and array["name"] not in names.split(","):
            continue
        if ids is not None and task["array"] not in ids.split(",") and not (by_task and key in ids.split(",")):
            continue
        yield key, task


def sacct(folder: Path, argv: list[str], faults: dict, call: Call) -> int:
    if _draw(folder, faults, "sacct", call):
        print("sacct: error: slurmdbd: Connection refused", file=call.err)
        return 1
    names = _option(argv, "--name")
    ids = _option(argv, "-j", "--jobs")
    with locked_state(folder) as state:
        lines = []
        for key, task in _listed(state, names, ids, by_task=False):
            shown = "RUNNING" if task.get("runaway") else task["state"]
            lines.append(f"{key}|{shown}" if _option(argv, "-o", "--format") != "JobID" else key)
    print("\n".join(lines), file=call.out)
    return 0


def scancel(folder: Path, argv: list[str], faults: dict, call: Call) -> int:
    sig = _option(argv, "--signal", "-s")
    idents = [a for a in argv if not a.startswith("-") and a != sig]
    with locked_state(folder) as state:
        for ident in idents:
            keys = _tasks_of(state, ident)
            if sig is None:  # a user's cancel: pending ones end now, running ones through the controller
                for key in keys:
                    task = state["tasks"][key]
                    if task["state"] == "PENDING":
                        task.update(state="CANCELLED", ended=time.time())
                    elif task["state"] == "RUNNING":
                        task["cancel_requested"] = True
                continue
            if call.random.random() < faults.get("not_alterable", 0.0):
                print(f"scancel: error: Kill job error on job id {ident}: Job can not be altered now", file=call.err)
                return 1
            for key in keys:
                step = folder / "steps" / key
                if state["tasks"][key]["state"] == "RUNNING" and step.exists():
                    try:
                        os.kill(int(step.read_text()), getattr(signal, f"SIG{sig}"))
                    except (ProcessLookupError, ValueError):
                        pass
    return 0


def scontrol(folder: Path, argv: list[str], faults: dict, call: Call) -> int:
    if argv[:2] == ["show", "config"]:
        print(f"MaxArraySize            = {faults.get('max_array_size', 1001)}", file=call.out)
        return 0
    if argv[:1] == ["requeue"]:
        with locked_state(folder) as state:
            for key in _tasks_of(state, argv[1]):
                task = state["tasks"][key]
                if task["state"] == "RUNNING":
                    task["requeue"] = True
                elif task["state"] not in ALIVE:
                    task.update(state="PENDING", restarts=task["restarts"] + 1, eligible=time.time())
        return 0
    print(f"scontrol: {' '.join(argv)}: not stood in for", file=call.err)
    return 1


@dataclass
class Call:
    """One call of a command: what it prints, what it prints as errors, and its random draws (seeded by the
    schedule, the command and how many calls of it came before)."""

    out: io.StringIO = field(default_factory=io.StringIO)
    err: io.StringIO = field(default_factory=io.StringIO)
    random: random.Random = field(default_factory=random.Random)


def run_command(folder: Path, command: str, argv: list[str]) -> tuple[int, str, str]:
    """``command`` (sbatch, squeue, ...) called with ``argv``: its exit code, output and error output."""
    faults = json.loads((folder / "faults.json").read_text())
    call = Call()
    with locked_state(folder) as state:
        calls = state.setdefault("calls", {})
        calls[command] = calls.get(command, 0) + 1
        call.random.seed(f"{faults.get('seed', 0)}:{command}:{calls[command]}")
    with open(folder / "calls.jsonl", "a") as f:
        f.write(json.dumps([command, *argv]) + "\n")
    if command == "sinfo":
        print("debug*|1:00:00|1|64|(null)", file=call.out)
        return 0, call.out.getvalue(), ""
    run = {"sbatch": sbatch, "squeue": squeue, "sacct": sacct, "scancel": scancel, "scontrol": scontrol}[command]
    code = run(folder, argv, faults, call)
    return code, call.out.getvalue(), call.err.getvalue()
