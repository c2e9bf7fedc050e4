"""Simulate one training step of a job on one rank of a fake world, without allocating its memory.

The model is built and parallelized by the trainer's own code (``torchtitan.training.step.build_model`` on a mesh from
``ParallelDims.build_mesh``) over a fake process group of the simulated world size, with every tensor a fake tensor
(``FakeTensorMode``: shapes, dtypes and devices, no data). Each optimizer is built by ``build_optimizers`` and its
state created by the optimizer's own code; then the step ``train.py`` runs, ``torchtitan.training.step.train_step``
(forward, loss, backward, clipping, optimizer step), runs under :class:`LiveMemoryTracker`, which counts live tensor
bytes on the simulated rank. For CUDA training the tracker also records the allocations and frees of the state's
creation, the step and a checkpoint save; :mod:`torchtitan.estimation.allocator` replays them, the step twice, through a
model of the CUDA caching allocator for the memory it reserves, under the job's ``PYTORCH_CUDA_ALLOC_CONF`` and the
alternatives.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.config.parsing import set_option
from torchtitan.distributed.cuda_allocator import alloc_conf_in_effect
from torchtitan.errors import UserError
from torchtitan.estimation.allocator import (
    OPTIMIZER_STEP,
    AllocatorConfig,
    Event,
    Replay,
    parse_alloc_conf,
    replay,
    training_sequence,
)
from torchtitan.estimation.compiled import compiled_blocks
from torchtitan.estimation.fake import fake_world, precompute_quantization_maps
from torchtitan.estimation.tracker import (
    OPTIMIZER_STATE,
    PARAMS,
    TRANSIENT,
    LiveMemoryTracker,
)
from torchtitan.optim.builder import (
    OPTIMIZERS,
    OptimizerKind,
    build_optimizers,
    resolve_optimizer_name,
)
from torchtitan.optim.container import tensor_bytes
from torchtitan.optim.settings import OPTIONAL_OPTIONS
from torchtitan.optim.state.quantized_checkpoint import QuantizedEntry
from torchtitan.training.garbage_collection import collecting_only_new_objects
from torchtitan.training.step import build_model, train_step

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
_CUDA_BLOCK_BYTES = 512

_LOW_BIT = ("AdamW8bit", "AdamW4bit", "AdamWFp8", "AdamMini8bit", "AdamMini4bit")
# Optimizers whose step is (or, for Muon, NorMuon and SOAP, includes) torch's AdamW/Adam, whose implementation
# torch chooses by device when ``optimizer.implementation`` is unset.
_TORCH_ADAM = ("AdamW", "Adam", "Muon", "NorMuon", "SOAP")
# Those whose AdamW part is torch's AdamW.
_ADAMW_PART = ("Muon", "NorMuon", "SOAP")

_LAYOUT_NAMES = {"dp_replicate": "replicas", "dp_shard": "FSDP", "tp": "TP"}

# The tracker's phases from the optimizer step on (_phase_hooks).
_STEP_PHASES = (OPTIMIZER_STEP, "after step")
# The allocator settings every CUDA estimate is also replayed under, beside the job's own.
ALTERNATIVE_ALLOC_CONFS = ("", "expandable_segments:True")
# Training steps replayed through the allocator model: the first fills its cache, the second shows the steady state.
REPLAYED_STEPS = 2


@dataclass
class OptimizerEstimate:
    """Bytes on the simulated rank for one optimizer."""

    optimizer: str
    params: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int
    peak_phase: str
    peak_breakdown: dict[str, int]
    state_source: str
    options: dict[str, Any] = field(default_factory=dict)  # the optional [optimizer] options it was built with
    implementation: str = ""  # the optimizer step's implementation that was simulated (see simulated_implementation)
    checkpoint_save_peak: int = 0  # the most live tensor memory while a checkpoint is saved after the step
    # CUDA only: the caching allocator's view of the run, one replay per allocator setting, the job's first.
    reserved: list[Replay] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The optimizer as ``memory_estimation.optimizers`` names it: ``AdamMini:state_dtype=bfloat16``."""
        return "".join([self.optimizer, *(f":{key}={value}" for key, value in self.options.items())])


@dataclass
class Estimate:
    flavor: str
    num_params: int
    vocab_size: int
    world_size: int
    degrees: dict[str, int]
    batch_size: int
    seq_len: int
    activation_checkpoint: str
    device: str
    param_dtype: str
    compute_dtype: str
    optimizers: list[OptimizerEstimate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    alloc_conf: str = ""  # the job's PYTORCH_CUDA_ALLOC_CONF (CUDA only)
    alloc_conf_source: str = ""
    device_memory: int = 0  # memory_estimation.device_memory_gib in bytes; 0: no limit

    @property
    def layout(self) -> str:
        parts = [f"{_LAYOUT_NAMES.get(name, name)} {degree}" for name, degree in self.degrees.items() if degree > 1]
        return " x ".join(parts) if parts else "single device"


# ----------------------------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class OptimizerChoice:
    """One entry of ``memory_estimation.optimizers``: a canonical optimizer name and ``[optimizer]`` options."""

    name: str
    options: tuple[tuple[str, str], ...] = ()


def optimizer_choices(spec: str) -> list[OptimizerChoice]:
    """Comma-separated ``NAME`` or ``NAME:option=value[:option=value]`` entries; UserError for a wrong one."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise UserError("memory_estimation.optimizers is empty; give comma-separated names such as AdamW,AdamMini")
    choices: list[OptimizerChoice] = []
    for entry in entries:
        name, *settings = (part.strip() for part in entry.split(":"))
        try:
            kind = resolve_optimizer_name(name)
        except UserError:
            raise UserError(
                f"memory_estimation.optimizers: unknown optimizer '{name}'; valid names: {', '.join(OPTIMIZERS)}"
            ) from None
        options = tuple(_option(entry, kind, setting) for setting in settings)
        choice = OptimizerChoice(kind.name, options)
        if choice not in choices:
            choices.append(choice)
    return choices


def _option(entry: str, kind: OptimizerKind, setting: str) -> tuple[str, str]:
    key, has_value, value = (part.strip() for part in setting.partition("="))
    where = f"memory_estimation.optimizers '{entry}'"
    if not has_value or key not in OPTIONAL_OPTIONS:
        raise UserError(f"{where}: options go as option=value, option one of {', '.join(OPTIONAL_OPTIONS)}")
    if key not in kind.options:
        raise UserError(f"{where}: optimizer.{key} does not apply to {kind.name}; remove it")
    try:
        set_option(JobConfig(), f"optimizer.{key}", value)  # the value checked as --optimizer.key would be
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return key, value


def vocab_size(job_config: JobConfig, notes: list[str]) -> int:
    """The vocabulary to size embedding and output with: the option, the tokenizer's, or the flavor's."""
    from torchtitan.models.llama import llama3_configs

    chosen = job_config.memory_estimation.vocab_size
    if chosen > 0:
        return chosen
    path = job_config.model.tokenizer_path
    if os.path.exists(path):  # a tokenizer file, or a Hugging Face model folder
        from torchtitan.datasets import build_tokenizer

        return build_tokenizer(path, job_config.model.tokenizer_type).n_words
    flavor_args = llama3_configs.get(job_config.model.flavor)
    if flavor_args is not None and flavor_args.vocab_size > 0:
        notes.append(
            f"tokenizer '{path}' not found: assumed the {job_config.model.flavor} vocabulary of "
            f"{flavor_args.vocab_size} tokens"
        )
        return flavor_args.vocab_size
    raise UserError(
        f"model.tokenizer_path '{path}' not found and flavor '{job_config.model.flavor}' has no vocabulary size; "
        "pass --memory_estimation.vocab_size N"
    )


def _job_for_simulation(job_config: JobConfig, notes: list[str]) -> JobConfig:
    """The job as it can be simulated on a CPU: eager, without float8 linears."""
    job = copy.deepcopy(job_config)
    if job.training.compile:
        job.training.compile = False  # the blocks are compiled by compiled_blocks, as the estimate can
        if job.training.tensor_parallel_degree > 1:
            notes.append(
                "training.compile with tensor parallelism is simulated in eager mode (compiled blocks usually hold "
                "fewer activations)"
            )
        else:
            notes.append(
                "training.compile: blocks simulated as AOT autograd compiles them (inductor's decompositions and "
                "partitioner), run op by op rather than as inductor's fused kernels"
            )
    if job.float8.enable_float8_linear:
        job.float8.enable_float8_linear = False
        notes.append("float8 linears are not simulated (they need a GPU); linears are estimated in the compute dtype")
    return job


def job_for_optimizer(job_config: JobConfig, choice: OptimizerChoice, notes: list[str]) -> JobConfig:
    """The job with ``choice``'s optimizer and options; configured options that it does not take are unset."""
    job = copy.deepcopy(job_config)
    name = job.optimizer.name = choice.name
    kind = OPTIMIZERS[name]
    for option in OPTIONAL_OPTIONS:
        if getattr(job.optimizer, option) is not None and option not in kind.options:
            setattr(job.optimizer, option, None)
            notes.append(f"optimizer.{option} does not apply to {name}; estimated with {name}'s default")
    for key, value in choice.options:
        set_option(job, f"optimizer.{key}", value)
    return job


def torch_default_implementation(job_config: JobConfig, device: str) -> Optional[str]:
    """The implementation torch's AdamW/Adam takes when ``optimizer.implementation`` is unset, on ``device``: foreach
    on CUDA (torch's default for CUDA tensors, DTensors included; our trainer keeps it), the per-tensor loop on CPU.
    None where the job's step is not torch's kernels with an unset implementation (Adam-mini, torchao's optimizers,
    and our compiled step for bf16 weights or moments other than float32)."""
    o = job_config.optimizer
    if o.name not in _TORCH_ADAM or o.implementation is not None:
        return None
    if (o.state_dtype or "float32") != "float32" or job_config.training.param_dtype == "bfloat16":
        return None
    return "foreach" if device == "cuda" else "for-loop"


def simulated_implementation(job_config: JobConfig, device: str) -> str:
    """The optimizer step's implementation that a run of ``job_config`` on ``device`` takes, as estimate rows name
    it (for Muon, NorMuon and SOAP, that of their AdamW part)."""
    o = job_config.optimizer
    prefix = "AdamW part: " if o.name in _ADAMW_PART else ""
    if o.name in _TORCH_ADAM:
        default = torch_default_implementation(job_config, device)
        if default is not None:
            return f"{prefix}{default} (torch's default on {device.upper()})"
        if o.implementation is not None:
            return f"{prefix}{o.implementation}"
        return (
            f"{prefix}compiled step ({o.state_dtype or 'float32'} moments, {job_config.training.param_dtype} weights)"
        )
    if o.name in ("AdamMini", "AdamMini8bit", "AdamMini4bit"):
        if o.implementation is not None:
            return o.implementation
        chosen = "foreach" if job_config.training.param_dtype == "float64" else "fused"
        return f"{chosen} (AdamMini's default)"
    if o.name == "AdEMAMix":  # compiled, except for float64 weights
        kind = "eager" if job_config.training.param_dtype == "float64" else "compiled"
        return f"{kind} step ({o.state_dtype or 'float32'} moments)"
    return "torchao's compiled step"


# ----------------------------------------------------------------------------------------------------------------
# The fake world


def fake_batches(batch_size: int, seq_len: int, vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield (torch.randint(0, vocab, (batch_size, seq_len)), torch.randint(0, vocab, (batch_size, seq_len)))


# ----------------------------------------------------------------------------------------------------------------
# One optimizer


@dataclass
class TracedStep:
    """What a training step does before its optimizer step, traced once and shared by every optimizer of an estimate.

    Forward, loss, backward and clipping do not depend on the optimizer: only its state (constant until the step)
    and its step differ. Each further optimizer runs its own step on the gradients left by this trace, and its
    sequence is ``events``, its step's events, then ``closing``.
    """

    events: list[Event]  # allocations and frees up to the optimizer step
    closing: list[Event]  # frees, after the step, of storages made before it (the loss, the gradient norm)
    phase_peaks: dict[str, tuple[int, dict[str, int]]]  # before the step: each phase's most live bytes, by category
    live_at_step: dict[str, int]  # live bytes by category as the optimizer step begins
    activations: int
    next_serial: int  # a storage number no event of the trace uses

    @classmethod
    def split(cls, tracker: LiveMemoryTracker, measured: dict) -> "TracedStep":
        """``tracker``'s step cut where its optimizer step begins (``measured["step_start"]``, see _phase_hooks)."""
        boundary, live = measured["step_start"]
        before, after = tracker.events[:boundary], tracker.events[boundary:]
        made_before = {e.serial for e in before if e.is_alloc}
        closing = [e for e in after if not e.is_alloc and e.serial in made_before]
        peaks = {phase: peak for phase, peak in tracker.phase_peaks.items() if phase not in _STEP_PHASES}
        serials = [e.serial for events in (tracker.events, *tracker.existing_events.values()) for e in events]
        return cls(before, closing, peaks, live, measured.get("activations", 0), max(serials, default=0) + 1)

    def peak_with_state(self, state: int) -> tuple[int, str, dict[str, int]]:
        """The most live bytes before the step, its phase and breakdown, with ``state`` bytes of optimizer state in
        place of the traced optimizer's (the state is constant until the step)."""
        traced_state = self.live_at_step.get(OPTIMIZER_STATE, 0)
        phase, (total, breakdown) = max(self.phase_peaks.items(), key=lambda item: item[1][0])
        breakdown = {**breakdown, OPTIMIZER_STATE: state}
        return total - traced_state + state, phase, {k: v for k, v in breakdown.items() if v}


def _optimizer_state_tensors(optimizers) -> list[torch.Tensor]:
    return [
        v
        for opt in optimizers.optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


@contextmanager
def _phase_hooks(tracker: LiveMemoryTracker, model: nn.Module, optimizers, measured: dict) -> Iterator[None]:
    """Name the phase the tracker is in, and measure the activations the forward pass leaves for backward."""

    def before_forward(module, args):
        tracker.phase = "forward"
        measured["transient_before_forward"] = tracker.live[TRANSIENT]

    def after_trunk(module, args, output):
        # The model's forward ends with the loss (output projection and cross-entropy) after its final norm; the
        # loss's backward ends when the final norm's output has its gradient.
        measured["activations"] = tracker.live[TRANSIENT] - measured["transient_before_forward"]
        tracker.phase = "loss"
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: setattr(tracker, "phase", "backward"))

    def before_step(*_):
        if "step_start" not in measured:  # the first of the container's optimizers
            measured["step_start"] = (len(tracker.events), dict(tracker.live))
        tracker.phase = OPTIMIZER_STEP

    def after_step(*_):
        tracker.phase = "after step"

    handles = [
        model.register_forward_pre_hook(before_forward),
        model.norm.register_forward_hook(after_trunk),
    ]
    for opt in optimizers.optimizers:
        handles += [opt.register_step_pre_hook(before_step), opt.register_step_post_hook(after_step)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _eager_optimizer_step(optimizers) -> Iterator[None]:
    """Run the optimizers' steps eagerly (fake tensors hold no data to compile kernels for: torchao's compiled
    steps), leaving compiled model blocks as they are."""
    step = optimizers.step

    def eager_step(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    optimizers.step = eager_step
    try:
        yield
    finally:
        del optimizers.step


def checkpoint_save_peak(model: nn.Module, optimizers, round_to: int) -> int:
    """The most live tensor memory while the checkpoint manager saves after the step (gradients still held)."""
    return checkpoint_save(model, optimizers, round_to).peak


def checkpoint_save(model: nn.Module, optimizers, round_to: int, record_events: bool = False) -> LiveMemoryTracker:
    """The tracker of a checkpoint save after the step (gradients still held).

    DCP's writer asks for each tensor's data in turn and copies it to host memory (not counted here) before the
    next: model weights and plain state are written from where they live, and a quantized state's data is its
    float32 values, made by ``QuantizedStateSavePlanner`` and dropped once copied. That is replayed here.
    """
    tracker = LiveMemoryTracker(round_to=round_to, record_events=record_events)
    tracker.track_existing(itertools.chain(model.parameters(), model.buffers()), PARAMS)
    tracker.track_existing((p.grad for p in model.parameters()), TRANSIENT)
    tracker.track_existing(_optimizer_state_tensors(optimizers), OPTIMIZER_STATE)
    with tracker, tracker.in_phase("checkpoint save"):
        for value in optimizers.state_dict().values():
            if isinstance(value, QuantizedEntry):
                value.local_values()
    return tracker


def _state_source(name: str) -> str:
    source = "created by the optimizer's own code on fake tensors"
    if name in _LOW_BIT:
        source += " (torchao's quantization maps computed for real beforehand)"
    return source


def estimate_optimizer(
    model: nn.Module,
    job_config: JobConfig,
    parallel_dims,
    batches,
    round_to: int,
    warm_up: bool = False,
    device: str = "cpu",
    alloc_confs: tuple[AllocatorConfig, ...] = (),
    device_memory: Optional[int] = None,
    traced: Optional[TracedStep] = None,
) -> tuple[OptimizerEstimate, TracedStep]:
    """Build the job's optimizer on ``model``, create its state, and track one training step; the estimate and the
    step's trace before its optimizer step, for the next optimizer.

    Without ``traced``, the whole step runs under the tracker. With it (another optimizer's trace of the same model,
    whose gradients are still held), only the optimizer step runs, on those gradients: forward, loss and backward are
    the traced ones, with this optimizer's state in place of the other's.
    ``warm_up`` runs one untracked step first: FSDP2 sets itself up during the first step of a model (its gathered
    parameters start as plain new tensors there, later as resized storages), and the estimate is of a steady step.
    ``device`` is the simulated training's (``memory_estimation.device``): the fake tensors live on the CPU, where
    torch's AdamW would take its per-tensor loop, so an unset implementation is built as the one torch takes on
    ``device`` (foreach on CUDA, whose temporaries are each the size of a whole state list).
    With ``alloc_confs`` (CUDA training), the state's creation (as ``train.py`` creates it, before the first step),
    the step and the save are recorded and replayed through the caching-allocator model under each setting, on a
    device of ``device_memory`` bytes (None: no limit).
    """
    options = {key: getattr(job_config.optimizer, key) for key in OPTIONAL_OPTIONS}
    options = {key: value for key, value in options.items() if value is not None}
    implementation = simulated_implementation(job_config, device)
    default = torch_default_implementation(job_config, device)
    if default is not None:
        job_config = copy.deepcopy(job_config)
        job_config.optimizer.implementation = default
    optimizers = build_optimizers([model], job_config)
    recording = bool(alloc_confs)
    creation = LiveMemoryTracker(round_to=round_to, record_events=recording)
    creation.track_existing(itertools.chain(model.parameters(), model.buffers()), PARAMS)
    with creation if recording else nullcontext(), creation.in_phase("optimizer state"):
        optimizers.initialise_state()  # with the optimizer's own code
    state_bytes = optimizers.state_bytes()
    if traced is None:
        tracker, traced = _whole_step(
            model, optimizers, job_config, parallel_dims, batches, round_to, warm_up, recording
        )
        step_events = tracker.events
        peak, peak_phase, peak_breakdown = tracker.peak, tracker.peak_phase, dict(tracker.peak_breakdown)
    else:
        tracker, state_live = _optimizer_step(model, optimizers, traced, round_to, recording)
        step_events = traced.events + tracker.events + traced.closing
        peak, peak_phase, peak_breakdown = traced.peak_with_state(state_live)
        if tracker.peak > peak:
            peak, peak_phase, peak_breakdown = tracker.peak, tracker.peak_phase, dict(tracker.peak_breakdown)
    gradients = sum(tensor_bytes(p.grad) for p in model.parameters())
    save = checkpoint_save(model, optimizers, round_to, record_events=recording)
    sequence = training_sequence(
        creation.existing_events.get(PARAMS, []),
        creation.events,
        step_events,
        steps=REPLAYED_STEPS,
        lazy_state=False,
        after=save.events,
    )
    reserved = [replay(sequence, config, device_memory) for config in alloc_confs]
    estimate = OptimizerEstimate(
        optimizer=optimizers.name,
        params=sum(tensor_bytes(p) for p in model.parameters()),
        gradients=gradients,
        optimizer_state=state_bytes,
        activations=traced.activations,
        peak=peak,
        peak_phase=peak_phase,
        peak_breakdown=peak_breakdown,
        state_source=_state_source(optimizers.name),
        options=options,
        implementation=implementation,
        checkpoint_save_peak=save.peak,
        reserved=reserved,
    )
    del optimizers
    gc.collect()
    return estimate, traced


def _whole_step(
    model: nn.Module,
    optimizers,
    job_config: JobConfig,
    parallel_dims,
    batches,
    round_to: int,
    warm_up: bool,
    recording: bool,
) -> tuple[LiveMemoryTracker, TracedStep]:
    """The tracker of a whole training step (``train_step``, after a warm-up step if asked), and its trace before
    the optimizer step. The step's gradients are left on the parameters."""
    device = torch.device("cpu")
    if warm_up:
        with torch.compiler.set_stance("force_eager"):
            train_step(model, optimizers, batches, parallel_dims, job_config, device)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    tracker = LiveMemoryTracker(round_to=round_to, record_events=recording)
    tracker.track_existing(itertools.chain(model.parameters(), model.buffers()), PARAMS)
    tracker.track_existing(_optimizer_state_tensors(optimizers), OPTIMIZER_STATE)
    measured: dict[str, Any] = {}
    # Fake tensors hold no data to compile kernels for: compiled optimizer steps (torchao) run eagerly.
    with _phase_hooks(tracker, model, optimizers, measured), _eager_optimizer_step(optimizers), tracker:
        train_step(model, optimizers, batches, parallel_dims, job_config, device)
    return tracker, TracedStep.split(tracker, measured)


def _optimizer_step(
    model: nn.Module, optimizers, traced: TracedStep, round_to: int, recording: bool
) -> tuple[LiveMemoryTracker, int]:
    """The tracker of ``optimizers``' step on the gradients ``traced`` left, starting from what was live as the
    traced step began its optimizer step (this optimizer's state in place of the traced one's), and the bytes of
    that state as counted."""
    tracker = LiveMemoryTracker(round_to=round_to, record_events=recording, first_serial=traced.next_serial)
    tracker.track_existing(itertools.chain(model.parameters(), model.buffers()), PARAMS)
    tracker.track_existing((p.grad for p in model.parameters()), TRANSIENT)
    tracker.track_existing(_optimizer_state_tensors(optimizers), OPTIMIZER_STATE)
    for category, nbytes in traced.live_at_step.items():
        if category != OPTIMIZER_STATE:  # what else the step began with: the loss, the gradient norm
            tracker.live[category] += nbytes - tracker.live[category]
    # Only what the step itself raises counts: the level it starts from is the traced step's.
    tracker.phase = tracker.peak_phase = OPTIMIZER_STEP
    tracker.peak, tracker.phase_peaks = 0, {}
    state = tracker.live[OPTIMIZER_STATE]
    with _phase_hooks(tracker, model, optimizers, {}), _eager_optimizer_step(optimizers), tracker:
        optimizers.step()
    return tracker, state


# ----------------------------------------------------------------------------------------------------------------
# The whole estimate


def estimate_memory(job_config: JobConfig) -> Estimate:
    """Per-rank memory of ``job_config``'s training for each optimizer in ``[memory_estimation]``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.config.preflight import model_args_for
    from torchtitan.parallelisms import ParallelDims, mixed_precision_mode, validate_model_for_parallelism

    settings = job_config.memory_estimation
    choices = optimizer_choices(settings.optimizers)
    notes: list[str] = []
    t = job_config.training
    try:
        parallel_dims = ParallelDims.from_job_config(job_config, settings.world_size)
    except UserError as e:
        raise UserError(f"memory_estimation.world_size {settings.world_size}: {e}") from None
    vocab = vocab_size(job_config, notes)
    model_args = model_args_for(job_config, vocab)
    validate_model_for_parallelism(model_args, parallel_dims)
    job = _job_for_simulation(job_config, notes)
    narrowed = mixed_precision_mode(parallel_dims, job_config, settings.device) is not None
    estimate = Estimate(
        flavor=job_config.model.flavor,
        num_params=0,
        vocab_size=vocab,
        world_size=settings.world_size,
        degrees=dict(parallel_dims.degrees),
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        activation_checkpoint=_ac_description(job_config),
        device=settings.device,
        param_dtype=t.param_dtype,
        compute_dtype=t.mixed_precision_param if narrowed else t.param_dtype,
        notes=notes,
    )
    round_to = _CUDA_BLOCK_BYTES if settings.device == "cuda" else 1
    alloc_confs = _alloc_confs(estimate, settings)
    world = fake_world(settings.world_size) if parallel_dims.any_parallelism else nullcontext()
    if any(choice.name in _LOW_BIT for choice in choices):
        precompute_quantization_maps()
    with world, collecting_only_new_objects():
        # Mesh and sharding plan are built for real (on the meta device); only tensors with data are fake.
        # The simulated mesh and fake tensors live on the CPU (fake collectives need no GPU); a CUDA job computes in
        # training.mixed_precision_param as train.py's would (FSDP2's policy, or autocast, here CPU autocast).
        model = build_model(
            job,
            model_args,
            parallel_dims,
            parallel_dims.build_mesh("cpu"),
            compute_device_type=settings.device,
            tensor_device_type="cpu",
        )
        estimate.num_params = sum(p.numel() for p in model.parameters())
        notes.extend(health_host_memory(job_config, model))
        notes.extend(health_device_memory(job_config, model_args, parallel_dims.degrees.get("tp", 1)))
        # Meta parameters become fake ones in to_empty, hence non-fake inputs are allowed.
        with FakeTensorMode(allow_non_fake_inputs=True), ExitStack() as stack:
            # No init_weights: values do not change memory, and fake tensors have none.
            model.to_empty(device="cpu")
            model.train()
            batches = fake_batches(t.batch_size, t.seq_len, vocab)
            compiling = t.compile and job_config.training.tensor_parallel_degree == 1
            stack.enter_context(compiled_blocks(model) if compiling else nullcontext())
            traced: Optional[TracedStep] = None  # the first optimizer's step, before its optimizer step
            for choice in choices:
                optimizer_job = job_for_optimizer(job, choice, notes)
                optimizer_estimate, traced = estimate_optimizer(
                    model,
                    optimizer_job,
                    parallel_dims,
                    batches,
                    round_to,
                    warm_up=traced is None,
                    device=settings.device,
                    alloc_confs=alloc_confs,
                    device_memory=estimate.device_memory or None,
                    traced=traced,
                )
                estimate.optimizers.append(optimizer_estimate)
            for p in model.parameters():
                p.grad = None
    return estimate


def _alloc_confs(estimate: Estimate, settings) -> tuple[AllocatorConfig, ...]:
    """The allocator settings to replay a CUDA job under: the job's (the environment's ``PYTORCH_CUDA_ALLOC_CONF``
    as ``train.py`` applies it), then the alternatives; none for CPU training."""
    if settings.device != "cuda":
        if settings.device_memory_gib:
            raise UserError("memory_estimation.device_memory_gib applies to device cuda only; remove it")
        return ()
    estimate.alloc_conf, estimate.alloc_conf_source = alloc_conf_in_effect(os.environ)
    estimate.device_memory = int(settings.device_memory_gib * 2**30)
    try:
        job = parse_alloc_conf(estimate.alloc_conf)
    except UserError as e:
        raise UserError(f"{e} ({estimate.alloc_conf_source})") from None
    configs = [job] + [parse_alloc_conf(text) for text in ALTERNATIVE_ALLOC_CONFS]
    unique = [c for i, c in enumerate(configs) if all(replace(c, text="") != replace(o, text="") for o in configs[:i])]
    if job.garbage_collection_threshold and not (job.memory_fraction and estimate.device_memory):
        estimate.notes.append(
            "garbage_collection_threshold: torch collects only under a per-process memory fraction on a GPU of "
            "known size (per_process_memory_fraction and memory_estimation.device_memory_gib); without both it "
            "changes nothing"
        )
    return tuple(unique)


def health_host_memory(job_config: JobConfig, model: nn.Module) -> list[str]:
    """What optimizer health holds in host memory per rank (the weights before a measured step, within
    metrics.health_snapshot_gib; torchtitan.telemetry.health.snapshot_bytes), said as a note: host memory is not in
    the table."""
    from torchtitan.telemetry.health import snapshot_bytes

    m = job_config.metrics
    if m.health_freq == 0:
        return []
    held = snapshot_bytes(list(model.parameters()), m.health_snapshot_gib)
    if held == 0:
        return [
            f"optimizer health: this rank's weights are above metrics.health_snapshot_gib {m.health_snapshot_gib:g}, "
            "so it holds no host copy of them and logs no update metrics"
        ]
    return [
        f"optimizer health: {held / 2**30:.2f} GiB of host memory per rank (pinned from a GPU), the weights before "
        f"a measured step, held for the whole run (metrics.health_snapshot_gib {m.health_snapshot_gib:g} bounds it)"
    ]


def health_device_memory(job_config: JobConfig, model_args, tp: int) -> list[str]:
    """A bound on the device memory a measured step's largest-logit measurement adds (not in the table: it runs
    between the steps' phases, without gradients): one block of scores in float32 (LOGIT_BLOCK_ELEMENTS) and its
    mask, and one layer's q and k as (batch x head) rows, widened to float32 block by block."""
    from torchtitan.models.llama.model import LOGIT_BLOCK_ELEMENTS

    if job_config.metrics.health_freq == 0:
        return []
    t = job_config.training
    heads = model_args.n_heads // tp
    head_dim = model_args.dim // model_args.n_heads
    rows = 2 * t.batch_size * t.seq_len * heads * head_dim * 4 * 2  # q and k, and their float32 blocks
    bound = 4 * LOGIT_BLOCK_ELEMENTS + LOGIT_BLOCK_ELEMENTS + rows
    return [
        f"optimizer health: a measured step's attention-logit measurement adds at most {bound / 2**20:,.0f} MiB of "
        "device memory for its duration (a block of scores, its mask, one layer's q and k)"
    ]


def _ac_description(job_config: JobConfig) -> str:
    ac = job_config.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode
    if ac.selective_ac_option == "op":
        return "selective (op policy)"
    return f"selective (1 block in {ac.selective_ac_option})"
