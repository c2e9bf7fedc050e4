"""[training], [loss], [activation_checkpoint], [float8] and [comm]: the step, its layout over ranks, its numerics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt
from torchtitan.training.lr_scheduling import DECAY_TYPES


@dataclass
class Training:
    dataset: str = opt(
        "sample",
        "dataset: sample (bundled, offline), c4 (streamed from the hub), text (local files) or tokens (a folder "
        "written by python -m torchtitan.tools.pretokenize)",
    )
    dataset_path: Optional[str] = opt(
        None, "local file or folder of text/json/jsonl/parquet files (any dataset), or the tokens folder"
    )
    data_seed: int = opt(
        0, "order of the windows of training.dataset 'tokens': a new permutation of them each epoch", ge=0
    )
    allow_data_change: bool = opt(
        False,
        "resume a checkpoint that read other data (another dataset fingerprint, data_seed, seq_len or held-out "
        "split): its data position is dropped and this data is read from its start",
    )
    batch_size: int = opt(8, "sequences per data-parallel rank per micro-batch", gt=0)
    data_workers: int = opt(
        1, "data-loader worker processes per rank that read and tokenize (0: in the training process)", ge=0
    )
    seq_len: int = opt(2048, "tokens per sequence", gt=0)
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step", gt=0)
    steps: int = opt(10000, "optimizer steps to train", gt=0)
    warmup_steps: int = opt(200, "linear warmup steps", ge=0)
    decay_type: str = opt("linear", "lr decay after warmup (sqrt: 1 - sqrt(progress))", choices=DECAY_TYPES)
    decay_ratio: Optional[float] = opt(
        None,
        "share of training.steps that decay, at the end (warmup-stable-decay: the peak lr in between); "
        "unset: every step after warmup decays",
        gt=0.0,
        le=1.0,
    )
    lr_min: float = opt(
        0.0,
        "lr floor as a fraction of the peak lr, reached one step after the last (so every step trains)",
        ge=0.0,
        le=1.0,
    )
    max_norm: float = opt(1.0, "gradient clipping by global norm; 0 disables clipping", ge=0.0)
    max_skipped_steps: int = opt(
        3,
        "consecutive steps with a non-finite loss or grad norm whose update is skipped before the run stops "
        "(exit code 3); 0 stops at the first",
        ge=0,
    )
    tf32: bool = opt(
        True,
        "float32 matmuls on TensorFloat-32 tensor cores where the GPU has them (compute capability 8.0 and newer): "
        "several times faster, with a 10-bit mantissa in the products (false: full float32; no effect on CPU)",
    )
    data_parallel_replicate_degree: int = opt(1, "HSDP replicas (1 = plain FSDP)", gt=0)
    data_parallel_shard_degree: int = opt(-1, "FSDP shards; -1 fills the world size", ge=-1)
    data_parallel_type: str = opt(
        "fsdp",
        "fsdp: shard over the data-parallel ranks; ddp: replicate the whole model on each of them (the same as "
        "data_parallel_replicate_degree = the data-parallel degree with data_parallel_shard_degree = 1)",
        choices=("fsdp", "ddp"),
    )
    tensor_parallel_degree: int = opt(1, "tensor-parallel degree", gt=0)
    disable_loss_parallel: bool = opt(False, "with tensor parallelism, gather logits instead of a parallel loss")
    param_dtype: str = opt("float32", "dtype of the model's master weights", choices=("float32", "float64", "bfloat16"))
    mixed_precision_param: str = opt(
        "bfloat16",
        "compute dtype on GPU: FSDP2's policy with data parallelism, else autocast (CPU computes in param_dtype)",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduction dtype on GPU", choices=("float32",))
    compile: bool = opt(False, "torch.compile each transformer block")
    seed: int = opt(0, "random seed for the initial weights (the data order does not depend on it)", ge=0)
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    gc_freq: int = opt(
        0,
        "N > 0: turn Python's automatic garbage collection off and collect every N steps on every rank at once "
        "(no rank pauses alone); 0 leaves Python's automatic collection on",
        ge=0,
    )


@dataclass
class Loss:
    num_chunks: int = opt(
        1,
        "output projection and cross-entropy over this many chunks of each micro-batch's tokens, so that the whole "
        "(tokens x vocabulary) logits never exist at once; 1 computes them whole",
        gt=0,
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "activation checkpointing: none, full or selective", choices=("none", "full", "selective"))
    selective_ac_option: str = opt("2", "selective: 'op' for the op-based policy, or k to checkpoint every k-th layer")


@dataclass
class Float8:
    enable_float8_linear: bool = opt(False, "torchao float8 linears (needs a CUDA GPU with compute capability >= 8.9)")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300,
        "seconds a rank waits for the others in the setup of the default process group, in the checkpoint's gloo "
        "collectives, and in the training collectives after the first step unless train_timeout_seconds is set, "
        "before the job fails (until the first step ends: first_step_timeout_seconds)",
        gt=0,
    )
    first_step_timeout_seconds: int = opt(
        1800,
        "from the process group's setup to the end of the first step, the timeout of the training collectives (the "
        "default group and the mesh's): it covers compiling the optimizer's step and the blocks, which a rank with a "
        "cold compile cache (a requeued job on new nodes) takes minutes longer to do than its peers",
        gt=0,
    )
    train_timeout_seconds: Optional[int] = opt(
        None,
        "after the first step, the timeout of the training collectives (the default group and the mesh's; "
        "checkpoint saves keep theirs); unset: init_timeout_seconds",
        gt=0,
    )
    trace_buf_size: Optional[int] = opt(
        None, "entries of NCCL's flight recorder (sets TORCH_NCCL_TRACE_BUFFER_SIZE unless already set)", ge=0
    )
