"""Checkpoints: save and resume model, optimizers, lr schedulers, data-loader position and train state.

Where: ``checkpoint.folder`` (relative to ``job.dump_folder`` unless absolute); unset, it is
``checkpoint/<optimizer state>``: the canonical optimizer name plus every option that shapes its state and is not at
its default (e.g. ``checkpoint/AdamMini``, ``checkpoint/AdamMini-state_dtype=bfloat16-value_blocks=per_tensor``;
``optim.settings.OPTION_RULES`` declares which options shape the state), so runs whose optimizer states differ never
share checkpoints. An explicit folder is used as given.

Layout of the checkpoint folder::

    step-10/               a complete checkpoint (torch.distributed.checkpoint format: .metadata + *.distcp, and
                           checksums.json: each file's size and XXH3-128 digest)
    step-20/
    step-20-weights/       the final weights-only export (model_weights_only), in export_dtype
    step-20-hf/            the final Hugging Face export (last_save_in_hf): config.json + safetensors
    .step-30.tmp-1a2b3c/   a save in progress (or one killed mid-way): never loaded, removed at the next start
    superseded/after-step-10-<time>/step-20/   checkpoints of a branch abandoned by a resume from step 10
    damaged/step-30-<time>/   a checkpoint a resume found damaged or incomplete: moved here, never deleted

and beside it ``.<folder name>.lock``, held by rank 0 of the live run using the folder: a second run is refused.

Crash safety: every save writes into a hidden temporary folder; only after all ranks finished writing does rank 0
rename it to ``step-N`` (atomic on one filesystem) and fsync the parent folder. A checkpoint that is visible is
therefore complete, and the last good one is never written over. A save whose model or optimizer state holds a
NaN or an infinity on any rank is refused (``DivergenceError``, nothing written), so every checkpoint is finite.
``keep_latest_k`` removes older checkpoints only after the new one is published, never the one just written, and
removes them by renaming first, so a crash mid-delete leaves a temporary folder, not a half-deleted ``step-N``. A step
saved again replaces the old copy by an atomic exchange (or, where the system has none, a rename aside that the next
start undoes if the new copy never arrived), so ``step-N`` is complete, old or new, at every point.

Lineage: resuming from step N (``checkpoint.load_step``) while newer checkpoints exist starts a branch; the newer
ones are moved to ``superseded/`` (never deleted; crash-safe through a marker file the next start completes), so
later saves, ``keep_latest_k`` and automatic resumes follow the branch that ran last. A divergence error names the
newest checkpoint this run published or resumed from.

Resharding: model and optimizer tensors are DTensors that DCP reshards on load, so a checkpoint saved on N ranks
loads on M. Everything else (schedulers, data-loader position, train state) is plain data, the same on every rank;
the data loader's holds every rank's reader positions, and how it resumes on another world size is its own rule
(``torchtitan/datasets/hf_datasets.py``).

Nothing a checkpoint's author chose is run on load:
- plain-data state (schedulers, data loader, ``states``) is stored as JSON text in a uint8 tensor;
- DCP's own non-tensor leaves (optimizer hyperparameters) are read with ``torch.load(weights_only=True)``;
- DCP's ``.metadata`` file is never unpickled: ``safe_reading`` walks its opcodes and builds DCP's metadata records
  itself, from an exact allow-list, and refuses anything else in one line naming the file.

Integrity (``integrity``): each file's checksum is recorded at save (hashed on its way to the disk) and verified
before a load, and the loaded model and optimizer values must be finite. A resume of the newest checkpoint passes
over one that is damaged, truncated, unreadable or incomplete: one line says which and what is wrong, the folder is
moved to ``damaged/``, and the run resumes from the newest checkpoint that verifies. An explicit
``checkpoint.load_step`` of a damaged step is refused instead (``UserError``), and so is a damaged
``initial_load_path`` (someone else's folder: nothing there is moved). Checkpoints of earlier versions, without
checksums, are loaded unverified, said in one line.

A save the system refuses (disk full, permission denied, quota) raises ``SaveFailed``: one line naming the cause and
the folder, exit code 5; its partial files are removed, the previous checkpoint is untouched. An async save's failure
is raised at the next step's ``save`` or at ``close()``.

When: every ``checkpoint.interval`` steps, or with ``interval_type = "seconds"`` once that many seconds passed since
the last save on rank 0's clock (broadcast on the checkpoint's gloo group, so every rank saves at the same step),
and always at the last step. ``create_seed_checkpoint`` saves the initial state as ``step-0`` into an empty folder.

Async mode (``checkpoint.async_mode = "async"``, or ``"async_with_pinned_mem"`` to stage through pinned CPU buffers
kept from one save to the next): the state is copied to CPU memory on the calling thread, then
written by a background thread over a gloo process group of its own (so its collectives never interleave with the
training loop's, nor with the checkpoint's own decisions on the training thread, such as the seconds broadcast).
A save waits for the previous one before starting; ``close()`` waits for the last one.

Quantized optimizer state (the low-bit optimizers) is saved as plain float32 tensors made one at a time, and loaded a
group at a time (``torchtitan.optim.state.quantized_checkpoint``): a save or load never holds a float32 copy of all of
it on the device.

Job facts: every checkpoint also holds a small plain record of the job that wrote it (optimizer, the options that shape
its state (``optim.settings.state_signature``), model flavor, parameter count and a digest of the parameter names and
shapes). A load compares it first, so a checkpoint of another optimizer state or model is refused with one line saying
what it holds and what the job expects.

Warm start: ``checkpoint.initial_load_path`` names a checkpoint (a ``step-N`` folder, or a folder of them: the latest)
to start from when the run's own folder holds none yet. With ``checkpoint.initial_load_model_only`` (the default)
only the model weights are loaded, from a checkpoint of any optimizer; the optimizer state, lr schedule, data
position and step start fresh. Otherwise everything is loaded, as a resume would, and must match the job.

Weights export: when ``checkpoint.model_weights_only`` is set, ``save`` at the last training step (``training.steps``)
also writes ``step-N-weights`` holding only the model's parameters in ``checkpoint.export_dtype``, keyed by their
parameter names, loadable with ``dcp.load`` into a ``Transformer``'s ``state_dict()``. With checkpointing enabled the
full checkpoint of that step is saved as usual, so the run stays resumable; the export also works with checkpointing
off. ``export_weights(step)`` does the same on demand.

Hugging Face: ``hf`` reads a Hugging Face Llama folder as the initial weights (``initial_load_in_hf``) and writes
one at the last step (``last_save_in_hf``); see its docstring.

Modules: ``codec`` (plain data as JSON bytes), ``hf`` (Hugging Face folders), ``safe_reading`` (the restricted
readers every load goes through), ``integrity`` (checksums), ``folders`` (step folders, temporary names, publish
and clean) and ``manager`` (``CheckpointManager`` and the job facts).
"""

from torchtitan.checkpoint.codec import decode_plain, encode_plain
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.safe_reading import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["CheckpointManager", "SafeFileSystemReader", "SafeLoadPlanner", "decode_plain", "encode_plain"]
