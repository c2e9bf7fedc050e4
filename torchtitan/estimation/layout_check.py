"""What a job's layout rules out for its optimizer, found before any worker starts.

Some optimizer settings work in one process and not in a layout: a quantized state is kept in blocks along a
weight's last dimension, and tensor parallelism may cut that dimension into parts that are not whole blocks
(``optim.state.storage.quantized_layout``). Such a rule lives with the optimizer's own code, where the state is
created; this check runs that code on the job's layout without any memory or any peer: the model built and
parallelized by the trainer's own code over a fake process group of the job's world size, its tensors fake
(shapes, no data, as the memory estimate has them), the optimizer built by ``build_optimizers`` and its state
created by its own first step (``initialise_state``, run eagerly). A refusal is one line naming the optimizer, the
layout and the fix; ``preflight`` runs this before ``torchrun`` starts anything.
"""

from __future__ import annotations

import copy

import torch

from torchtitan.errors import UserError


def layout_description(parallel_dims) -> str:
    """The job's layout in its own option names, e.g. ``training.tensor_parallel_degree 2``."""
    parts = []
    if parallel_dims.dp_replicate > 1:
        parts.append(f"training.data_parallel_replicate_degree {parallel_dims.dp_replicate}")
    if parallel_dims.dp_shard > 1:
        parts.append(f"training.data_parallel_shard_degree {parallel_dims.dp_shard}")
    if parallel_dims.tp > 1:
        parts.append(f"training.tensor_parallel_degree {parallel_dims.tp}")
    return " x ".join(parts) or "one process"


def check_optimizer_layout(job_config, parallel_dims, model_args) -> None:
    """Raise UserError (one line) when the job's optimizer cannot keep its state in the job's layout."""
    if not parallel_dims.any_parallelism:
        return  # one process: nothing is split, the optimizer's own checks have run
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan.estimation.fake import fake_world, precompute_quantization_maps
    from torchtitan.logging import quiet
    from torchtitan.optim import build_optimizers
    from torchtitan.optim.builder import resolve_optimizer_name
    from torchtitan.optim.settings import BLOCK_SIZE
    from torchtitan.training.step import build_model

    job = copy.deepcopy(job_config)
    job.training.compile = False  # compiling changes no layout; the check stays quick
    job.float8.enable_float8_linear = False  # float8 needs its GPU, checked on its own; the weights' layout is the same
    if BLOCK_SIZE in resolve_optimizer_name(job_config.optimizer.name).options:  # quantized state: torchao's maps
        precompute_quantization_maps()
    with fake_world(parallel_dims.world_size), quiet():  # the run itself logs what it builds
        mesh = parallel_dims.build_mesh("cpu")
        model = build_model(job, model_args, parallel_dims, mesh, compute_device_type="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True), torch.compiler.set_stance("force_eager"):
            model.to_empty(device="cpu")
            try:
                build_optimizers([model], job).initialise_state()
            except UserError as e:
                raise UserError(
                    f"optimizer.name {job_config.optimizer.name} cannot run at {layout_description(parallel_dims)}: {e}"
                ) from None
