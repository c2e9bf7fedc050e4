"""The checkpoint manager: what a training job saves and resumes, and the job facts that guard a load.

See the package docstring (``torchtitan/checkpoint/__init__.py``) for the folder layout and the guarantees.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import time
import warnings
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

import torchtitan.checkpoint.hf as hf
from torchtitan.checkpoint.codec import decode_plain, encode_plain
from torchtitan.checkpoint.folders import (
    DAMAGED_FOLDER,
    DEFAULT_FOLDER,
    STEP_FOLDER,
    FolderInUse,
    complete_steps,
    hf_folder,
    incomplete_steps,
    publish,
    recover,
    remove_folder,
    remove_tree,
    resolve_folder,
    set_aside_damaged,
    set_aside_newer,
    step_folder,
    temporary_name,
    try_lock_folder,
    weights_folder,
)
from torchtitan.checkpoint.integrity import ChecksummingWriter, read_record, verify_files
from torchtitan.checkpoint.safe_reading import (
    METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnreadableCheckpoint,
    read_metadata_file,
)
from torchtitan.distributed.collectives import all_gather_objects, all_reduce_scalar, any_rank
from torchtitan.distributed.utils import DTYPES
from torchtitan.errors import SaveFailed, UserError
from torchtitan.logging import logger
from torchtitan.optim.settings import OPTION_RULES, canonical_name, state_signature
from torchtitan.optim.state.quantized_checkpoint import (
    QuantizedStateSavePlanner,
    entry_sources,
    read_in_groups,
    scales_keys,
    stage_entries,
)
from torchtitan.training.guard import (
    DivergenceError,
    resume_hint,
    state_tensors,
    tensors_are_finite,
)

MODEL, OPTIMIZER, LR_SCHEDULERS, DATALOADER = "model", "optimizer", "lr_schedulers", "dataloader"
JOB_FACTS = "job_facts"
RESERVED_KEYS = (MODEL, OPTIMIZER, LR_SCHEDULERS, DATALOADER, JOB_FACTS)


def model_state_of(part: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(part)`` with each tied weight once (under the embedding's name)."""
    state = get_model_state_dict(part)
    for repeated in getattr(part, "tied_weights", dict)():
        state.pop(repeated, None)
    return state


def load_model_state(part: nn.Module, state: dict[str, Any]) -> None:
    """``set_model_state_dict`` of a state from ``model_state_of``: the tied entries point at their source again."""
    tied = getattr(part, "tied_weights", dict)()
    set_model_state_dict(part, {**state, **{repeated: state[source] for repeated, source in tied.items()}})


def job_facts(job_config: Any, model_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint of this job holds, in plain data: compared on load before any tensor is read."""
    shapes = sorted((name, list(value.shape)) for name, value in model_state.items())
    return {
        "optimizer": canonical_name(job_config.optimizer.name),
        "optimizer_state": state_signature(job_config),
        "model_flavor": job_config.model.flavor,
        "parameters": sum(value.numel() for value in model_state.values()),
        "model_digest": hashlib.sha256(json.dumps(shapes).encode("utf-8")).hexdigest()[:16],
    }


def _optimizer_state(facts: dict[str, Any]) -> dict[str, Any]:
    """The state-shaping options a checkpoint's facts record (checkpoints of earlier versions: the state dtype)."""
    if "optimizer_state" in facts:
        return dict(facts["optimizer_state"])
    return {"state_dtype": facts["state_dtype"]} if "state_dtype" in facts else {}


def _describe_optimizer(facts: dict[str, Any]) -> str:
    """The optimizer's name and the state-shaping options it set away from their defaults."""
    state = _optimizer_state(facts)
    options = ", ".join(
        f"{k} {v}"
        for k, v in state.items()
        if v is not None and (k not in OPTION_RULES or v != OPTION_RULES[k].unset_means)
    )
    return facts["optimizer"] + (f" ({options})" if options else "")


def _describe_model(facts: dict[str, Any]) -> str:
    return f"model flavor {facts['model_flavor']} ({facts['parameters']:,} parameters)"


def facts_mismatch(saved: dict[str, Any], expected: dict[str, Any], model_only: bool) -> Optional[tuple[str, str]]:
    """What differs between a checkpoint's job facts and this job's: ("model" or "optimizer", in words), or None.

    Optimizers differ when their names or any state-shaping option both record differ.
    """
    if saved["model_digest"] != expected["model_digest"]:
        same_size = saved["model_flavor"] == expected["model_flavor"] and saved["parameters"] == expected["parameters"]
        other = " but other parameter names or shapes" if same_size else ""
        return "model", f"holds {_describe_model(saved)}{other}; this job uses {_describe_model(expected)}"
    if model_only:
        return None
    saved_state, expected_state = _optimizer_state(saved), _optimizer_state(expected)
    states_differ = any(saved_state[k] != expected_state[k] for k in saved_state.keys() & expected_state.keys())
    if saved["optimizer"] != expected["optimizer"] or states_differ:
        written, used = _describe_optimizer(saved), _describe_optimizer(expected)
        return "optimizer", f"was written by {written}; this job uses {used}"
    return None


def flat_items(state: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested dict, keyed as DCP flattens them ("a.b.c")."""
    items = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            items.extend(flat_items(value, name + "."))
        else:
            items.append((name, value))
    return items


def flat_keys(state: dict[str, Any]) -> list[str]:
    return [name for name, _ in flat_items(state)]


def _shape_mismatches(state: dict[str, Any], entries: dict[str, Any]) -> list[str]:
    """Tensors whose shape in the checkpoint differs from this job's (e.g. Adam-mini's ``v`` under other value
    blocks), as "key: saved shape vs this job's shape"."""
    wrong = []
    for name, value in flat_items(state):
        saved = getattr(entries.get(name), "size", None)
        if isinstance(value, torch.Tensor) and saved is not None and tuple(saved) != tuple(value.shape):
            wrong.append(f"{name}: {tuple(saved)} there, {tuple(value.shape)} here")
    return wrong


class CheckpointManager:
    """Saves and resumes a training job; see the package docstring for the folder layout and guarantees.

    ``optimizers`` and ``lr_schedulers`` expose ``state_dict()`` / ``load_state_dict()``; ``data_loader`` is a
    checkpointable loader (or None) whose state is the same on every rank (``state_dict()`` may be a collective:
    every rank saves and loads together);
    ``states`` maps names to objects with ``state_dict()`` / ``load_state_dict()`` returning plain data.
    """

    def __init__(
        self,
        data_loader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        job_config: Any,
        token_ids: Optional[dict[str, int]] = None,
    ) -> None:
        clash = set(states) & set(RESERVED_KEYS)
        if clash:
            raise ValueError(f"states may not use the reserved names {sorted(clash)}")
        self.data_loader = data_loader
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.states = dict(states)
        config = job_config.checkpoint
        self.enabled = config.enable_checkpoint
        self.export_enabled = config.model_weights_only
        self.interval = config.interval
        self.interval_in_seconds = config.interval_type == "seconds"
        self.clock = time.monotonic  # seconds; replaceable in tests
        self._last_save_time = self.clock()
        self.keep_latest_k = config.keep_latest_k
        self.async_enabled = config.async_mode in ("async", "async_with_pinned_mem")
        # Pinned staging buffers are allocated at the first save and reused by the next ones.
        self._stager = _pinned_stager() if config.async_mode == "async_with_pinned_mem" else None
        self.hf_load = config.initial_load_in_hf
        self.hf_export_enabled = config.last_save_in_hf
        self.token_ids = token_ids  # the tokenizer's bos/eos ids, for the Hugging Face config.json
        self.load_step = config.load_step
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.job_config = job_config
        self.default_folder = config.folder is None
        self.export_dtype = DTYPES[config.export_dtype]
        self.last_step = job_config.training.steps
        self.folder = resolve_folder(job_config)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: Optional[tuple[Any, str, str, int]] = None  # (future, temporary folder, final folder, step)
        self._last_saved_step = -1  # the newest step saved or being saved (a save in flight included)
        self._last_published_step = -1  # the newest step known to be visible as a complete checkpoint
        self._release_folder = None  # lets go of rank 0's hold on the folder (see _lock_folder)
        self._group = None  # the manager's collectives on the training thread
        self._save_group = None  # an async save's collectives, on DCP's background thread
        if not (self.enabled or self.export_enabled or self.hf_export_enabled):
            return
        if dist.is_initialized():
            # Our own gloo groups: CPU tensors coordinate ranks whatever the main backend is, and nothing here
            # interleaves with the training loop's collectives. An async save talks from a background thread while
            # the loop goes on deciding the next save (``_due``): each thread gets its group, since collectives of
            # two threads on one group meet in a different order on different ranks. Their collectives wait as long
            # as the default group's (comm.init_timeout_seconds), not torch's default.
            timeout = timedelta(seconds=job_config.comm.init_timeout_seconds)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            if self.async_enabled:
                self._save_group = dist.new_group(backend="gloo", timeout=timeout)
        # Locked first: a run refused by the lock touches nothing of the live run's folder (not even a write probe).
        self._lock_folder()
        self.check_writable()
        if self.rank == 0:
            for note in recover(self.folder):
                logger.info(f"checkpoint: in {self.folder}: {note}")
        self._barrier()
        mode = "async (background thread, dedicated gloo group)" if self.async_enabled else "synchronous"
        unit = "seconds" if self.interval_in_seconds else "steps"
        logger.info(
            f"checkpoint: folder {self.folder}, every {self.interval} {unit}, {mode}, keep "
            f"{self.keep_latest_k or 'all'}"
            + (f", export weights as {config.export_dtype}" if self.export_enabled else "")
        )

    # -- public API ------------------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Raise UserError (on every rank) unless this rank can create files in the checkpoint folder."""
        problem = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            probe = os.path.join(self.folder, f".write-probe-{os.getpid()}-{secrets.token_hex(4)}")
            with open(probe, "wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as e:
            problem = e.strerror or str(e)
        if self._any_rank(problem is not None):
            raise UserError(
                f"checkpoint folder '{self.folder}' is not writable ({problem or 'on another rank'}); fix its "
                "permissions or point checkpoint.folder / job.dump_folder at a writable folder"
            )

    def _lock_folder(self) -> None:
        """Refuse (on every rank) a folder another live run uses: its start-up would remove that run's save in
        progress. Rank 0 alone holds the lock, whatever the number of nodes (see ``folders.try_lock_folder``)."""
        holder = None
        if self.rank == 0:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.folder)), exist_ok=True)
                lock, holder = try_lock_folder(self.folder)
                if lock is not None:
                    # Released once: by close(), or when a manager dropped without it (a tool's, a test's) is freed.
                    self._release_folder = weakref.finalize(self, lock.release)
            except OSError as e:
                logger.warning(
                    f"checkpoint: cannot lock {self.folder} ({e.strerror or e}); a second run started on this folder "
                    "would not be refused"
                )
        if self._any_rank(holder is not None):
            raise FolderInUse(
                f"checkpoint folder '{self.folder}' is in use by another run ({holder or 'as rank 0 found'}); wait "
                "for it to end, or give this run another checkpoint.folder"
            )

    def load(self, step: int = -1) -> bool:
        """Resume from ``step`` (or ``checkpoint.load_step``, or the latest complete checkpoint); True if loaded.

        When the folder holds no checkpoint, start from ``checkpoint.initial_load_path`` if one is given.
        """
        if not self.enabled:
            if step >= 0 or self.load_step >= 0:
                logger.warning("checkpoint: load_step is ignored because checkpoint.enable_checkpoint is off")
            return self._initial_load()
        requested = step if step >= 0 else self.load_step
        if requested < 0:
            for incomplete in self._rank_0s(incomplete_steps(self.folder)):
                self._set_aside_damaged(incomplete, f"'{step_folder(self.folder, incomplete)}' has no {METADATA_FILE}")
        steps = complete_steps(self.folder)
        if requested >= 0 and requested not in steps:
            available = ", ".join(map(str, steps)) or "none"
            raise UserError(
                f"checkpoint.load_step {requested} has no complete checkpoint in '{self.folder}' "
                f"(available steps: {available}); pick one of those or -1 for the latest"
            )
        if not steps:
            if self._initial_load():
                return True
            self._warn_about_earlier_folders()
            logger.info(f"checkpoint: nothing to resume in {self.folder}; starting from scratch")
            return False
        begin = time.perf_counter()
        if requested >= 0:
            try:
                self._load_verified(step_folder(self.folder, requested))
            except UnreadableCheckpoint as e:
                others = ", ".join(str(s) for s in steps if s != requested) or "none"
                raise UserError(
                    f"checkpoint.load_step {requested} is not loaded: {e}; pick another step (available: {others}) "
                    "or -1 for the newest that verifies"
                ) from None
            chosen = requested
        else:
            chosen = self._load_newest_verified(steps)
        self._last_saved_step = self._last_published_step = chosen
        logger.info(f"checkpoint: resumed from step {chosen} in {time.perf_counter() - begin:.2f} s")
        if chosen < steps[-1]:
            self._start_branch(chosen, [s for s in steps if s > chosen])
        return True

    def _load_newest_verified(self, steps: list[int]) -> int:
        """Load the newest of ``steps`` that verifies; each newer one is moved to ``damaged/``, said in one line."""
        for candidate in reversed(steps):
            try:
                self._load_verified(step_folder(self.folder, candidate))
                return candidate
            except UnreadableCheckpoint as e:
                self._set_aside_damaged(candidate, str(e))
        raise UserError(
            f"no checkpoint in '{self.folder}' verifies: each was moved to {DAMAGED_FOLDER}/ with its reason logged; "
            "run again to start from scratch, or move a checkpoint you trust back"
        )

    def _set_aside_damaged(self, step: int, problem: str) -> None:
        if self.rank == 0:
            target = set_aside_damaged(self.folder, step)
            logger.warning(f"checkpoint: step-{step} is damaged and passed over: {problem}; moved to {target}")
        self._barrier()

    def _rank_0s(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what it saw of the shared folder decides for all)."""
        return all_gather_objects(value, self._group)[0]

    def _start_branch(self, chosen: int, newer: list[int]) -> None:
        """Resumed from an older step: the newer checkpoints belong to the abandoned branch. Moved aside (never
        deleted), they are neither resumed nor counted by keep_latest_k; this run's saves are the branch."""
        if self.rank == 0:
            target = set_aside_newer(self.folder, chosen)
            logger.warning(
                f"checkpoint: resumed from step {chosen} while newer checkpoints existed (steps "
                f"{', '.join(map(str, newer))}); moved them to {target}, so that saves and later resumes follow "
                "this run"
            )
        self._barrier()

    def save(self, curr_step: int, force: bool = False) -> None:
        """Save at multiples of ``checkpoint.interval`` and when forced; export weights at the last step if asked."""
        if self.enabled:
            self._publish_pending(wait=False)
            if self._due(curr_step, force) and curr_step != self._last_saved_step:
                self._save_full(curr_step)
                self._last_save_time = self.clock()
        if self.export_enabled and curr_step == self.last_step:
            self.export_weights(curr_step)
        if self.hf_export_enabled and curr_step == self.last_step:
            self.export_hf(curr_step)

    def _due(self, step: int, force: bool) -> bool:
        """Whether ``step`` saves: every ``interval`` steps, or once ``interval`` seconds passed on rank 0's clock.

        Clocks differ between ranks, so rank 0 decides and broadcasts on the checkpoint's gloo group (a CPU tensor,
        which that backend reduces): all ranks save together or none does. An async save in flight talks on its own
        group meanwhile, so the two never interleave.
        """
        if force:
            return True
        if not self.interval_in_seconds:
            return step % self.interval == 0
        decision = torch.tensor([int(self.clock() - self._last_save_time >= self.interval)], dtype=torch.int64)
        if self._group is not None:
            dist.broadcast(decision, src=dist.get_global_rank(self._group, 0), group=self._group)
        return bool(decision.item())

    def create_seed_checkpoint(self) -> str:
        """Save the initial state as step 0 (``checkpoint.create_seed_checkpoint``); refuse a folder that has steps."""
        steps = complete_steps(self.folder)
        if steps:
            raise UserError(
                f"checkpoint.create_seed_checkpoint: '{self.folder}' already holds checkpoints (steps "
                f"{', '.join(map(str, steps))}); point checkpoint.folder at an empty folder"
            )
        self._save_full(0)
        self._publish_pending(wait=True)
        return step_folder(self.folder, 0)

    def export_hf(self, step: int) -> str:
        """Write the model's weights as a Hugging Face Llama folder ``step-N-hf`` in ``export_dtype``; its path."""
        self._publish_pending(wait=True)
        final = hf_folder(self.folder, step)
        state = self._model_state()
        self._refuse_non_finite(state, step)
        begin = time.perf_counter()
        temporary = temporary_name(final, self._shared_token())
        if self.rank == 0:
            os.makedirs(temporary, exist_ok=True)
        hf.write_hf_weights(
            state, temporary, self.model_parts[0].args, self.export_dtype, self.rank, token_ids=self.token_ids
        )
        self._publish_everywhere(temporary, final)
        logger.info(f"checkpoint: exported Hugging Face weights to {final} in {time.perf_counter() - begin:.2f} s")
        return final

    def export_weights(self, step: int) -> str:
        """Write the model's parameters alone, in ``checkpoint.export_dtype``, to ``step-N-weights``; its path."""
        self._publish_pending(wait=True)
        final = weights_folder(self.folder, step)
        weights = {
            name: value.to(self.export_dtype) if value.is_floating_point() else value
            for name, value in self._model_state().items()
        }
        self._refuse_non_finite(weights, step)
        begin = time.perf_counter()
        temporary = temporary_name(final, self._shared_token())
        os.makedirs(temporary, exist_ok=True)
        with _single_process_quiet():
            dcp.save(weights, storage_writer=ChecksummingWriter(temporary), process_group=self._group)
        self._publish_everywhere(temporary, final)
        logger.info(f"checkpoint: exported weights to {final} in {time.perf_counter() - begin:.2f} s")
        return final

    def last_finite_step(self) -> Optional[int]:
        """The newest published checkpoint this run saved or resumed from (a save in flight is waited for); None if
        none. Every checkpoint written here is finite (see ``_refuse_non_finite``), so it is safe to resume from."""
        if not self.enabled:
            return None
        try:
            self._publish_pending(wait=True)
        except Exception as e:  # a failed background save is not a checkpoint to name; the run is stopping anyway
            self._pending = None
            logger.error(f"checkpoint: the save in flight failed: {e}")
        return self._last_published_step if self._last_published_step >= 0 else None

    def resume_hint(self) -> str:
        """Where a diverged run can resume from, as the end of its error message."""
        return resume_hint(self.last_finite_step(), self.folder if self.enabled else None)

    def close(self) -> None:
        """Wait for an async save in flight and publish it."""
        if self._group is None and not (self.enabled or self.export_enabled or self.hf_export_enabled):
            return
        self._publish_pending(wait=True)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._barrier()
        if self._release_folder is not None:
            self._release_folder()

    # -- saving ----------------------------------------------------------------------------------------------------

    def _save_full(self, step: int) -> None:
        # Only one save in flight: the next one starts after the previous one is published.
        self._publish_pending(wait=True)
        begin = time.perf_counter()
        final = step_folder(self.folder, step)
        state = self._state_to_save()
        optimizer_tensors = entry_sources(state[OPTIMIZER])
        self._refuse_non_finite({MODEL: state[MODEL], OPTIMIZER: optimizer_tensors}, step)
        temporary = temporary_name(final, self._shared_token())
        with self._naming_save_failures(step, temporary):
            self._write_full(step, state, temporary, final, begin)

    def _write_full(self, step: int, state: dict[str, Any], temporary: str, final: str, begin: float) -> None:
        os.makedirs(temporary, exist_ok=True)
        writer = ChecksummingWriter(temporary)
        self._last_saved_step = step
        if self.async_enabled:
            # Quantized optimizer states are copied to host memory here, one at a time; DCP stages the rest.
            state = stage_entries(state)
            with _single_process_quiet():
                extra = {"async_stager": self._stager} if self._stager is not None else {}
                result = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=QuantizedStateSavePlanner(),
                    process_group=self._save_group,
                    **extra,
                )
            # Newer torch may return a response whose upload_completion is the future to wait on.
            future = getattr(result, "upload_completion", result)
            self._pending = (future, temporary, final, step)
            logger.info(f"checkpoint: step {step} staged in {time.perf_counter() - begin:.2f} s, writing in background")
            return
        with _single_process_quiet():
            dcp.save(state, storage_writer=writer, planner=QuantizedStateSavePlanner(), process_group=self._group)
        self._publish_everywhere(temporary, final)
        logger.info(f"checkpoint: saved step {step} in {time.perf_counter() - begin:.2f} s")

    @contextlib.contextmanager
    def _naming_save_failures(self, step: int, temporary: str):
        """Turn a save that the system refused (disk full, permission denied, quota, ...) into one SaveFailed line
        naming the cause and the folder; its partial files are removed, the previous checkpoint is untouched."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as e:
            cause = save_failure_cause(e, self.folder)
            if cause is None:
                raise
            if self.rank == 0:
                remove_tree(temporary)
            previous = (
                f"step-{self._last_published_step} is intact"
                if self._last_published_step >= 0
                else "no earlier checkpoint of this run"
            )
            raise SaveFailed(
                f"checkpoint of step {step} could not be written to '{self.folder}': {cause}; {previous}. Free space "
                "or fix the folder's permissions (or point checkpoint.folder elsewhere), then run the same command "
                "to resume"
            ) from None

    def _refuse_non_finite(self, state: dict[str, Any], step: int) -> None:
        """Raise DivergenceError on every rank if any rank's share of ``state`` holds a NaN or an infinity.

        Nothing is written then, so ``keep_latest_k`` never trades a finite checkpoint for a broken one.
        """
        if self._any_rank(not tensors_are_finite(state_tensors(state))):
            raise DivergenceError(
                f"training diverged: the model or optimizer state is non-finite at step {step}, so its checkpoint "
                "was not written; " + self.resume_hint()
            )

    def _publish_pending(self, wait: bool) -> None:
        if self._pending is None:
            return
        future, temporary, final, step = self._pending
        if not wait and not future.done():
            return
        self._pending = None
        with self._naming_save_failures(step, temporary):
            future.result()  # re-raises a failed background save
        # DCP writes the metadata file on rank 0 after every rank's data is written, so a finished save on rank 0
        # is a complete checkpoint: rank 0 can publish it without another collective.
        if self.rank == 0:
            self._publish_and_prune(temporary, final)
            logger.info(f"checkpoint: published {final}")
        self._note_published(final)  # on every rank, for its resume hints: the save is complete, rank 0 names it

    def _publish_everywhere(self, temporary: str, final: str) -> None:
        self._barrier()  # every rank has written its part
        if self.rank == 0:
            self._publish_and_prune(temporary, final)
        self._barrier()  # nobody moves on before the checkpoint is visible
        self._note_published(final)

    def _publish_and_prune(self, temporary: str, final: str) -> None:
        publish(temporary, final)
        match = STEP_FOLDER.match(os.path.basename(final))
        if not (self.keep_latest_k and match):
            return
        # The newest k - 1 others stay with the one just written, which is never pruned.
        written = int(match.group(1))
        others = [step for step in complete_steps(self.folder) if step != written]
        for old in others[: max(0, len(others) - (self.keep_latest_k - 1))]:
            remove_folder(step_folder(self.folder, old))
            logger.info(f"checkpoint: removed step-{old} (keep_latest_k={self.keep_latest_k})")

    def _note_published(self, final: str) -> None:
        match = STEP_FOLDER.match(os.path.basename(final))
        if match:
            self._last_published_step = int(match.group(1))

    def _state_to_save(self) -> dict[str, Any]:
        state: dict[str, Any] = {MODEL: self._model_state(), OPTIMIZER: self.optimizers.state_dict()}
        plain = {**self._plain_states(), JOB_FACTS: job_facts(self.job_config, state[MODEL])}
        for name, value in plain.items():
            state[name] = torch.frombuffer(bytearray(encode_plain(value)), dtype=torch.uint8)
        return state

    def _plain_objects(self) -> dict[str, Any]:
        """The objects whose state is saved as JSON, by name: reading the names calls no ``state_dict()`` (the
        data loader's is a collective and starts its workers)."""
        objects: dict[str, Any] = {}
        if self.lr_schedulers is not None:
            objects[LR_SCHEDULERS] = self.lr_schedulers
        if self.data_loader is not None:
            objects[DATALOADER] = self.data_loader
        objects.update(self.states)
        return objects

    def _plain_states(self) -> dict[str, Any]:
        """Everything saved as JSON, identical on every rank (DCP writes it once)."""
        return {name: obj.state_dict() for name, obj in self._plain_objects().items()}

    def _model_state(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(model_state_of(part))
        return merged

    # -- loading ---------------------------------------------------------------------------------------------------

    def _initial_load(self) -> bool:
        """Start from ``checkpoint.initial_load_path`` (model weights only, or everything); False if none is set."""
        if self.initial_load_path is None:
            return False
        if self.hf_load:
            return self._initial_load_hf()
        path = self.initial_load_path
        if not os.path.isfile(os.path.join(path, METADATA_FILE)):
            steps = complete_steps(path)
            if not steps:
                raise UserError(
                    f"checkpoint.initial_load_path '{path}' holds no complete checkpoint; point it at a step-N folder "
                    "(or a folder of them) written by a finished save"
                )
            path = step_folder(path, steps[-1])
            passed_over = [step for step in incomplete_steps(self.initial_load_path) if step > steps[-1]]
            if passed_over and self.rank == 0:
                logger.warning(
                    f"checkpoint: initial_load_path '{self.initial_load_path}': passed over the incomplete "
                    f"{', '.join(f'step-{s}' for s in passed_over)} (no {METADATA_FILE}); starting from {path}"
                )
        begin = time.perf_counter()
        metadata = self._verified_metadata(path)
        if self.initial_load_model_only:
            saved = self._load_model_from(path, metadata)
            written_by = f" (written by {_describe_optimizer(saved)})" if saved else ""
            logger.info(
                f"checkpoint: started from the model weights of {path}{written_by} in "
                f"{time.perf_counter() - begin:.2f} s; optimizer state, lr schedule, data position and step are fresh"
            )
        else:
            self._load_from(path, metadata)
            logger.info(f"checkpoint: started from {path} (everything) in {time.perf_counter() - begin:.2f} s")
        return True

    def _initial_load_hf(self) -> bool:
        """Start from the weights of the Hugging Face folder ``checkpoint.initial_load_path``."""
        begin = time.perf_counter()
        part_states = [model_state_of(part) for part in self.model_parts]
        merged = {k: v for part_state in part_states for k, v in part_state.items()}
        with _single_process_quiet():
            hf.load_hf_weights(merged, self.initial_load_path, self.model_parts[0].args, self._group)
        for part, part_state in zip(self.model_parts, part_states):
            load_model_state(part, {k: merged[k] for k in part_state})
        logger.info(
            f"checkpoint: started from the Hugging Face weights in {self.initial_load_path} in "
            f"{time.perf_counter() - begin:.2f} s; optimizer state, lr schedule, data position and step are fresh"
        )
        return True

    def _warn_about_earlier_folders(self) -> None:
        """Checkpoints in the default folders of earlier versions are not resumed by default; say so once: the
        shared folder, and the folder named after the optimizer alone, which earlier versions used whatever its
        state options (it may also be this optimizer's at its default state, so a warning, not a refusal)."""
        if not self.default_folder or self.rank != 0:
            return
        shared = os.path.dirname(self.folder)
        steps = complete_steps(shared)
        if steps:
            logger.warning(
                f"checkpoint: {shared} holds checkpoints outside the per-optimizer-state folders (steps "
                f"{', '.join(map(str, steps))}); they are not resumed: to resume them, pass --checkpoint.folder "
                f"{DEFAULT_FOLDER} (and the optimizer that wrote them)"
            )
        bare_name = canonical_name(self.job_config.optimizer.name)
        if os.path.basename(self.folder) == bare_name:
            return
        bare = os.path.join(shared, bare_name)
        steps = complete_steps(bare)
        if steps:
            logger.warning(
                f"checkpoint: {bare} holds checkpoints of {bare_name} (steps {', '.join(map(str, steps))}), which "
                f"earlier versions wrote there whatever its state options; if this run wrote them, resume them with "
                f"--checkpoint.folder {os.path.join(DEFAULT_FOLDER, bare_name)}"
            )

    def _load_model_from(self, path: str, metadata: Any) -> Optional[dict[str, Any]]:
        """Load the model weights of the verified checkpoint at ``path`` only; its job facts (None for older
        checkpoints)."""
        part_states = [model_state_of(part) for part in self.model_parts]
        state: dict[str, Any] = {MODEL: {k: v for part_state in part_states for k, v in part_state.items()}}
        saved = self._check_matches(path, metadata, state, [], model_only=True)
        self._read_part(path, metadata, state)
        self._refuse_non_finite_load(path, state[MODEL])
        for part, part_state in zip(self.model_parts, part_states):
            load_model_state(part, {k: state[MODEL][k] for k in part_state})
        return saved

    def _load_verified(self, path: str) -> None:
        """Verify the checkpoint at ``path`` (its checksums, its metadata) and load it; UnreadableCheckpoint, on
        every rank, when it is damaged."""
        self._load_from(path, self._verified_metadata(path))

    def _verified_metadata(self, path: str) -> Any:
        """The metadata of the checkpoint at ``path`` once its files match their checksums; raises
        UnreadableCheckpoint on every rank, with the first problem any rank found, when they do not."""
        problem, metadata = None, None
        try:
            files = read_record(path)
            if files is None:
                if self.rank == 0:
                    logger.warning(
                        f"checkpoint: '{path}' has no checksums (written by an earlier version); it is loaded "
                        "unverified"
                    )
            else:
                rank = dist.get_rank(self._group) if self._group is not None else 0
                world = dist.get_world_size(self._group) if self._group is not None else 1
                share = sorted(set(sorted(files)[rank::world]) | {METADATA_FILE})
                problem = verify_files(path, files, share)
            if problem is None:
                metadata = read_metadata_file(os.path.join(path, METADATA_FILE))
                unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(files or {}))
                if files is not None and unlisted:
                    problem = f"'{path}' has data files without checksums ({', '.join(unlisted[:3])})"
        except (ValueError, UnreadableCheckpoint) as e:
            problem = str(e)
        problems = [p for p in all_gather_objects(problem, self._group) if p is not None]
        if problems:
            raise UnreadableCheckpoint(problems[0])
        return metadata

    def _refuse_non_finite_load(self, path: str, *states: Any) -> None:
        """Raise UnreadableCheckpoint on every rank if what was read holds a NaN or an infinity: every save here is
        finite, so such values are damage."""
        if self._any_rank(not tensors_are_finite(state_tensors(list(states)))):
            raise UnreadableCheckpoint(f"'{path}' holds non-finite model or optimizer values (damaged)")

    def _load_from(self, path: str, metadata: Any) -> None:
        part_states = [model_state_of(part) for part in self.model_parts]
        optimizer_state = self.optimizers.state_dict()
        state: dict[str, Any] = {
            MODEL: {k: v for part_state in part_states for k, v in part_state.items()},
            OPTIMIZER: optimizer_state,
        }
        self._without_unsaved_scales(path, metadata, optimizer_state)
        plain_names = list(self._plain_objects())
        self._check_matches(path, metadata, state, plain_names)
        for name in plain_names:
            state[name] = torch.empty(metadata.state_dict_metadata[name].size, dtype=torch.uint8)
        # Quantized optimizer states are read after the rest, a group at a time (never all as float32 at once).
        read_in_groups(state, lambda part: self._read_part(path, metadata, part), agree_on_count=self._max_over_ranks)
        # Nothing is handed to the optimizer or the plain states before the values are known finite (the model's
        # tensors, read in place, are read again by the next load tried, or the run stops).
        self._refuse_non_finite_load(path, state[MODEL], entry_sources(optimizer_state))

        for part, part_state in zip(self.model_parts, part_states):
            load_model_state(part, {k: state[MODEL][k] for k in part_state})
        self.optimizers.load_state_dict(optimizer_state)
        plain = {name: decode_plain(state[name].numpy().tobytes()) for name in plain_names}
        for name, obj in self._plain_objects().items():
            obj.load_state_dict(plain[name])

    @staticmethod
    def _without_unsaved_scales(path: str, metadata: Any, optimizer_state: dict[str, Any]) -> None:
        """Read a checkpoint saved without block scales (older ones) by quantizing its values alone, said once."""
        unsaved = [k for k in scales_keys(optimizer_state) if f"{OPTIMIZER}.{k}" not in metadata.state_dict_metadata]
        if not unsaved:
            return
        for key in unsaved:
            del optimizer_state[key]
        logger.warning(
            f"checkpoint: '{path}' holds no block scales for {len(unsaved)} quantized optimizer states (saved by an "
            "earlier version); they are quantized again from their values, within one quantization step"
        )

    def _read_part(self, path: str, metadata: Any, state: dict[str, Any]) -> None:
        """Fill ``state`` in place from the checkpoint at ``path`` whose ``metadata`` was verified (DCP reads only the
        keys given); UnreadableCheckpoint when its data cannot be read."""
        try:
            with _single_process_quiet():
                dcp.load(
                    state,
                    storage_reader=SafeFileSystemReader(path, metadata),
                    planner=SafeLoadPlanner(),
                    process_group=self._group,
                )
        except CheckpointException as e:
            causes = "; ".join(sorted({f"{type(err).__name__}: {err}" for err, _ in e.failures.values()}))
            raise UnreadableCheckpoint(f"'{path}' cannot be read ({causes or e})") from None

    def _check_matches(
        self, path: str, metadata: Any, state: dict[str, Any], plain_names: list[str], model_only: bool = False
    ) -> Optional[dict[str, Any]]:
        """Raise one short UserError unless the checkpoint fits ``state``; the checkpoint's job facts, if it has them.

        The job facts are compared first, so that the message says what the checkpoint holds; checkpoints without
        them are judged by their keys, summarised in one line.
        """
        entries = metadata.state_dict_metadata
        saved = self._read_facts(path, metadata)
        if saved is not None:
            mismatch = facts_mismatch(saved, job_facts(self.job_config, state[MODEL]), model_only)
            if mismatch is not None:
                kind, words = mismatch
                raise UserError(f"checkpoint '{path}' {words}; {self._how_to_proceed(path, model_only, kind)}")
        missing = [k for k in flat_keys(state) if k not in entries and not any(s.startswith(k + ".") for s in entries)]
        missing += [
            k
            for k in plain_names
            if getattr(entries.get(k), "properties", None) is None or entries[k].properties.dtype != torch.uint8
        ]
        for problems, what, sep in (
            (missing, "missing", ", "),
            (_shape_mismatches(state, entries), "of other shapes", "; "),
        ):
            if problems:
                shown = sep.join(problems[:2]) + (f" and {len(problems) - 2} more" if len(problems) > 2 else "")
                kind = "model" if problems[0].startswith(MODEL + ".") else "other"
                raise UserError(
                    f"checkpoint '{path}' does not match this job ({len(problems)} entries {what}: {shown}); "
                    f"{self._how_to_proceed(path, model_only, kind)}"
                )
        return saved

    @staticmethod
    def _how_to_proceed(path: str, model_only: bool, kind: str) -> str:
        if model_only:
            return "point checkpoint.initial_load_path at a checkpoint of this model"
        if kind == "model":
            return "resume with the model settings that wrote it, or use another checkpoint.folder"
        return (
            "use another checkpoint.folder (unset, each optimizer state gets its own), or start from its model "
            f"weights with a fresh optimizer: --checkpoint.initial_load_path {path} and an empty checkpoint.folder"
        )

    def _read_facts(self, path: str, metadata: Any) -> Optional[dict[str, Any]]:
        """The job facts saved in the checkpoint at ``path`` (None for checkpoints written before they existed)."""
        entry = metadata.state_dict_metadata.get(JOB_FACTS)
        if getattr(entry, "properties", None) is None or entry.properties.dtype != torch.uint8:
            return None
        blob = {JOB_FACTS: torch.empty(entry.size, dtype=torch.uint8)}
        self._read_part(path, metadata, blob)
        facts = decode_plain(blob[JOB_FACTS].numpy().tobytes())
        needed = {"optimizer", "model_flavor", "parameters", "model_digest"}
        return facts if isinstance(facts, dict) and needed <= set(facts) else None

    # -- coordination (on our gloo group, CPU tensors) -----------------------------------------------------------

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _any_rank(self, flag: bool) -> bool:
        # Without our group (one process, or nothing to save) there is no one to ask: any_rank would use the world.
        return flag if self._group is None else any_rank(flag, torch.device("cpu"), self._group)

    def _max_over_ranks(self, count: int) -> int:
        if self._group is None:
            return count
        return int(all_reduce_scalar(count, "max", self._group, torch.device("cpu")))

    def _shared_token(self) -> str:
        """A random suffix for temporary folders, the same on every rank (rank 0 draws it)."""
        value = torch.tensor([secrets.randbits(48)], dtype=torch.int64)
        if self._group is not None:
            dist.broadcast(value, src=dist.get_global_rank(self._group, 0), group=self._group)
        return f"{int(value.item()):012x}"


# What a failed write's errno means, in words.
_SAVE_ERRORS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "an input/output error",
    errno.EFBIG: "a file is larger than the file system allows",
}
_NEARLY_FULL_BYTES = 64 << 20


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, what it wraps (DCP's failures on each rank) and the exceptions it was raised from, depth first."""
    seen: list[BaseException] = []
    todo = [error]
    while todo and len(seen) < 100:
        current = todo.pop()
        if any(current is s for s in seen):
            continue
        seen.append(current)
        if isinstance(current, CheckpointException):
            todo.extend(failure for failure, _ in current.failures.values())
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return seen


def save_failure_cause(error: BaseException, folder: str) -> Optional[str]:
    """Why the system refused a save, in words; None when ``error`` is not the system refusing (a bug, kept whole).

    An errno says it directly; torch's archive writer says only "unexpected pos" when a write came up short, so a
    disk found (nearly) full says it then.
    """
    causes = _causes(error)
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno in _SAVE_ERRORS:
            where = f" at {cause.filename}" if cause.filename else ""
            return f"{_SAVE_ERRORS[cause.errno]} ({cause.strerror}{where})"
    try:
        stats = os.statvfs(folder)
        free, total = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
    except OSError:
        free, total = None, None
    if free is not None and free < min(_NEARLY_FULL_BYTES, total // 100 + 1):
        return f"the disk is full ({free / 2**20:.1f} MiB free of {total / 2**20:.0f} MiB)"
    system = [c for c in causes if isinstance(c, OSError)]
    if system:
        return f"{type(system[0]).__name__}: {system[0]}"
    return None


def _pinned_stager():
    """DCP's stager into pinned CPU buffers that stay allocated across saves (torch >= 2.9 has it)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns on every call that it assumes one process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
