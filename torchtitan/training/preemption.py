"""Stopping cleanly when a scheduler asks: finish the step, save a checkpoint, exit with its own code.

Slurm warns a job before it kills it: at preemption and at the time limit every process gets SIGTERM (then SIGKILL
after the cluster's grace time), and ``sbatch --signal=USR1@SECONDS`` sends SIGUSR1 that long before the time limit.
train.py installs :class:`Preemption` before training; the handler only notes the signal, and the divergence
guard's all-reduce of each step carries it (``DivergenceGuard.stop_requested``: no collective of its own per step,
nor a gloo group of its own). All ranks agree on it (a max over the world, so that a rank signalled a moment later
stops at the same step; a signal that comes after a step's guard is seen at the next step's), save the step they are
at whatever the checkpoint interval, and leave with :class:`torchtitan.errors.Preempted`, whose exit code
(:data:`torchtitan.errors.PREEMPTED_EXIT_CODE`) tells a job script to requeue the run; started again with the same
command, it resumes from that checkpoint, bit for bit.

Later stop signals change nothing (torchrun, itself signalled, passes SIGTERM on to its workers), but torchrun
SIGKILLs its workers ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds after that (30 by default; the Slurm job scripts set
the warning less 10 s): under torchrun, two steps and a save must fit in that time. Ctrl-C (SIGINT) still interrupts
at once.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Callable, Optional

from torchtitan.errors import Preempted

# The signals that ask a run to save and stop: Slurm's warning ahead of a time limit, and its (or anyone's) SIGTERM.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def ignore_stop_signals(worker_id: int = 0, owner: Optional[int] = None) -> None:
    """A data loader worker's ``worker_init_fn``: the stop signals are the training process's to handle (Slurm
    signals every process of a job step; a worker ended by one would fail the step it should finish).

    SIGUSR1 is ignored. SIGTERM is ignored too unless ``owner`` (the process whose loader started the worker) or the
    worker's own parent sends it: that is how the loader ends its workers (``multiprocessing`` terminates its live
    daemonic children at exit, the data loader after a timed-out join), and a worker that ignored it would leave
    the loader waiting forever. Under fork and spawn the parent is the owner; under forkserver (Python 3.14's
    default) it is the fork server, so the owner is passed in (:func:`worker_init`). The sender is read with
    ``sigwaitinfo`` on a thread of its own, SIGTERM being blocked in every thread of the worker."""
    senders = {os.getppid()} | ({owner} if owner is not None else set())
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignore)  # where a thread leaves SIGTERM unblocked, it is ignored there
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask
    threading.Thread(target=_end_on_sigterm_from, args=(senders,), name="sigterm-from-owner", daemon=True).start()


def worker_init() -> Callable[[int], None]:
    """The ``worker_init_fn`` of a data loader built in this process: :func:`ignore_stop_signals`, with this
    process as the owner whose SIGTERM ends a worker under any start method."""
    return functools.partial(ignore_stop_signals, owner=os.getpid())


def _ignore(signum, frame) -> None:
    pass


def _end_on_sigterm_from(senders: set[int]) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid in senders:
            os._exit(128 + signal.SIGTERM)  # as the default action would (the owner only joins it)


class Preemption:
    """Notes a stop signal; :meth:`signalled` is this rank's answer, which the divergence guard's all-reduce makes
    every rank's."""

    def __init__(self, signals=STOP_SIGNALS):
        self.received: Optional[int] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.received = self.received or signum  # later ones change nothing: torchrun passes its own SIGTERM on

    def signalled(self) -> bool:
        """Whether this rank received a stop signal."""
        return self.received is not None

    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stop(self, checkpoint, step: int, updated: bool, metric_logger) -> Preempted:
        """Save ``step`` (unless it was skipped: never a checkpoint at a skipped step), wait for the save, close the
        metrics; the exception that ends the run."""
        if updated:
            checkpoint.save(step, force=True)
        saved = checkpoint.last_finite_step()
        checkpoint.close()
        metric_logger.close()
        self.restore()
        received = self.signal_name()
        if saved is None:
            return Preempted(f"stopped on {received} after step {step}; {checkpoint.resume_hint()}")
        return Preempted(
            f"stopped on {received} after step {step}, checkpoint of step {saved} saved; run the same command again "
            "to resume from it"
        )
