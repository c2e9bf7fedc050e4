"""The job configuration: defaults, then a TOML file, then ``--section.key value`` overrides.

Every option lives in exactly one dataclass field below, with its default and a one-line help text in
``metadata``. Range checks are declared next to the field (``ge``, ``gt``, ``lt``, ``le``, ``choices``) so that the
TOML loader, the command-line parser and ``--help`` all read the same facts; the Adam hyperparameters are checked by
``torchtitan.optim.settings``, as the optimizer builder and ``AdamMini`` check them. Mistakes raise
:class:`torchtitan.errors.UserError` with one line naming the key and, for typos, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from torchtitan.errors import UserError
from torchtitan.legacy_config import LEGACY_KEYS, LEGACY_SECTIONS, refuse_both_names, translate
from torchtitan.lr_scheduling import DECAY_TYPES
from torchtitan.models.norm_types import NORM_TYPES, RMSNORM_TYPES
from torchtitan.models.rope_types import ROPE_SCALING_TYPES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


# Each run's resolved config, written beside its metrics (train.py) and read back by ``--job.config_file``.
JOB_CONFIG_RECORD = "job_config.toml"


WANDB_INSTALL = "pip install -e '.[wandb]'"  # the optional extra that metrics.enable_wandb needs


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A config field: its default, one line of help and its range checks."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


@dataclass
class Job:
    config_file: Optional[str] = opt(None, "TOML job config to load before command-line overrides")
    dump_folder: str = opt("./outputs", "folder for TensorBoard logs, checkpoints and traces")
    description: str = opt("default job", "free-text description of the job, logged at start")
    print_args: bool = opt(False, "log the full resolved config at start")
    use_for_integration_test: bool = opt(
        False, "a train_configs/ file the test suite checks through JobConfig and preflight"
    )


@dataclass
class Model:
    name: str = opt("llama3", "model family", choices=("llama3",))
    flavor: str = opt(
        "debugmodel",
        "model size from llama3_configs (debugmodel, 8B, 70B, 405B: Llama 3; 3.1-8B, 3.1-70B, 3.1-405B, 3.2-1B, "
        "3.2-3B: as published, scaled RoPE and 3.2's tied output)",
    )
    tokenizer_path: str = opt(
        "./assets/tokenizer/tiktoken_test.model",
        "tokenizer: a tiktoken BPE or sentencepiece file, a Hugging Face tokenizer.json, or a Hugging Face model "
        "folder holding one",
    )
    tokenizer_type: str = opt(
        "auto",
        "tokenizer format; auto: huggingface for a folder or *.json file, else tiktoken or sentencepiece by content",
        choices=("auto", "tiktoken", "sentencepiece", "huggingface"),
    )
    # The names are torchtitan's; the three RMSNorm variants compute the same function.
    norm_type: str = opt(
        "rmsnorm",
        "normalisation layers: rmsnorm, compiled_rmsnorm (each norm compiled), fused_rmsnorm (F.rms_norm), "
        "layernorm (scale and shift), np_layernorm (LayerNorm without parameters)",
        choices=NORM_TYPES,
    )
    # Unset: the flavor's. The factors apply to llama3 scaling only (set with "none", they are refused).
    # A plain string ("none" means no scaling here, not an unset option).
    rope_scaling: str = opt(
        "flavor",
        "RoPE frequency scaling: none, llama3 (Llama 3.1 and later), or flavor (the flavor's)",
        choices=("flavor", *ROPE_SCALING_TYPES),
    )
    rope_scaling_factor: Optional[float] = opt(
        None, "llama3 RoPE scaling: divisor of the low frequencies (unset: the flavor's, else 8)", ge=1.0
    )
    rope_low_freq_factor: Optional[float] = opt(
        None,
        "llama3 RoPE scaling: wavelengths above original_max_seq_len / this are scaled (unset: flavor's, else 1)",
        gt=0.0,
    )
    rope_high_freq_factor: Optional[float] = opt(
        None,
        "llama3 RoPE scaling: wavelengths below original_max_seq_len / this are kept (unset: flavor's, else 4)",
        gt=0.0,
    )
    rope_original_max_seq_len: Optional[int] = opt(
        None,
        "llama3 RoPE scaling: the context length the model was first trained at (unset: flavor's, else 8192)",
        gt=0,
    )
    enable_weight_tying: Optional[bool] = opt(
        None, "one parameter for the embedding and the output projection (unset: the flavor's; 3.2-1B/3B: true)"
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "optimizer: AdamW, Adam, AdamMini, AdamMini8bit, AdamMini4bit, AdamW8bit, AdamW4bit, "
        "AdamWFp8, Muon, NorMuon, AdEMAMix, SOAP (case-insensitive)",
    )
    # Read, checked and resolved in one pass by torchtitan.optim.settings (lr, betas, eps, weight_decay: torch.optim's
    # rules; which optimizer takes which option: its TAKES table).
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "first-moment decay")
    beta2: float = opt(0.95, "second-moment decay")
    eps: float = opt(1e-8, "denominator epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to norms and biases by AdamMini)")
    implementation: Optional[str] = opt(
        None,
        "for-loop, foreach or fused where the optimizer has them (AdamMini: foreach or fused, the default); "
        "unset picks the optimizer's default",
        choices=("for-loop", "foreach", "fused"),
    )
    state_dtype: Optional[str] = opt(
        None,
        "AdamW, Adam: dtype of both moments; AdamMini: dtype of its first moment; Muon, NorMuon: their momentum and "
        "their AdamW part's moments; AdEMAMix: its three moments (unset: float32, also for bfloat16 weights; "
        "bfloat16 is stochastically rounded)",
        choices=("float32", "bfloat16"),
    )
    # AdamMini only.
    value_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of value weights per output row (per_row) or per tensor (per_tensor)",
        choices=("per_row", "per_tensor"),
    )
    embedding_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of the embedding per token (per_row, adam-mini 1.1.1's) or per element (per_element, "
        "Adam's, as Adam-mini's first release); unset: per_row",
        choices=("per_row", "per_element"),
    )
    output_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of the output projection per token (per_row) or per element (per_element); unset: "
        "per_row",
        choices=("per_row", "per_element"),
    )
    attn_out_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of attention output weights per output neuron (per_row, 1.1.1's) or one for the "
        "whole matrix (per_tensor, the first release's); unset: per_row",
        choices=("per_row", "per_tensor"),
    )
    mlp_blocks: Optional[str] = opt(
        None,
        "AdamMini: second moment of MLP weights per output neuron (per_row) or one for the whole matrix "
        "(per_tensor); unset: per_row",
        choices=("per_row", "per_tensor"),
    )
    norm_weight_decay: Optional[bool] = opt(
        None, "AdamMini: decay the norms' scales too (unset: false, as adam-mini 1.1.1: neither norms nor biases)"
    )
    # torchao low-bit optimizers only.
    block_size: Optional[int] = opt(None, "low-bit AdamW and AdamMini: quantization block size", gt=0)
    bf16_stochastic_round: Optional[bool] = opt(
        None, "low-bit AdamW: stochastic rounding of the updated weights (needs training.param_dtype bfloat16)"
    )
    # Muon and NorMuon only (their AdamW part takes lr, beta1, beta2, eps, weight_decay, implementation and
    # state_dtype).
    momentum: Optional[float] = opt(
        None, "Muon, NorMuon: momentum of the hidden matrices (unset: 0.95)", ge=0.0, lt=1.0
    )
    nesterov: Optional[bool] = opt(None, "Muon, NorMuon: Nesterov momentum (unset: true)")
    ns_steps: Optional[int] = opt(None, "Muon, NorMuon: Newton-Schulz iterations (unset: 5)", gt=0, lt=100)
    ns_dtype: Optional[str] = opt(
        None,
        "Muon, NorMuon: dtype of the Newton-Schulz iteration (unset: bfloat16, as torch.optim.Muon)",
        choices=("bfloat16", "float32", "float64"),
    )
    adjust_lr: Optional[str] = opt(
        None,
        "Muon, NorMuon: lr scale of a matrix update: match_rms_adamw (0.2 sqrt(max dim): optimizer.lr means what it "
        "means for AdamW) or original (sqrt(max(1, rows/cols))); unset: match_rms_adamw",
        choices=("match_rms_adamw", "original"),
    )
    # NorMuon only.
    neuron_beta2: Optional[float] = opt(
        None,
        "NorMuon: decay of the per-row (neuron-wise) second moment of the orthogonalised update (unset: 0.95)",
        ge=0.0,
        lt=1.0,
    )
    neuron_eps: Optional[float] = opt(
        None, "NorMuon: added to the root of the per-row second moment before dividing (unset: 1e-8)", ge=0.0
    )
    normuon_step_size: Optional[str] = opt(
        None,
        "NorMuon: reference (the reference code's: Muon's lr scale times ||O||_F / ||N||_F) or rms (the paper's: "
        "0.2 lr sqrt(rows cols) / ||N||_F, an update RMS of exactly 0.2 lr); unset: reference",
        choices=("reference", "rms"),
    )
    # AdEMAMix only (optimizer.beta1 and beta2 are its fast momentum's and second moment's decays).
    ademamix_alpha: Optional[float] = opt(
        None,
        "AdEMAMix: weight of the slow momentum in the update, reached at the end of its warm-up (unset: 5)",
        ge=0.0,
    )
    ademamix_beta3: Optional[float] = opt(
        None,
        "AdEMAMix: decay of the slow momentum, reached at the end of its warm-up (unset: 0.9999)",
        gt=0.0,
        lt=1.0,
    )
    ademamix_warmup_steps: Optional[int] = opt(
        None,
        "AdEMAMix: steps over which alpha rises linearly from 0 and beta3 from beta1 (the paper's schedules); 0: "
        "none; unset: training.steps, as the paper",
        ge=0,
    )
    # SOAP only (Adam in the eigenbasis of Shampoo's preconditioner: beta1, beta2 and eps are its Adam's, and its
    # AdamW part's with weight_decay and implementation).
    precondition_frequency: Optional[int] = opt(
        None, "SOAP: refresh the eigenbases after every this many updates (unset: 10)", gt=0
    )
    max_precondition_dim: Optional[int] = opt(
        None,
        "SOAP: a matrix side longer than this is not rotated (no statistic or basis kept for it; unset: 10000)",
        gt=0,
    )
    shampoo_beta: Optional[float] = opt(
        None, "SOAP: decay of Shampoo's statistics G G^T and G^T G (unset: beta2)", ge=0.0, lt=1.0
    )


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
class Validation:
    enable: bool = opt(False, "evaluate the loss on held-out data every validation.freq steps and at the last step")
    freq: int = opt(100, "evaluate every N optimizer steps (and at the last step)", gt=0)
    steps: int = opt(
        10,
        "text data: batches per data-parallel rank per evaluation (fewer if the validation data runs out first); "
        "tokens data scores validation.windows instead",
        gt=0,
    )
    windows: int = opt(
        64,
        "tokens data: validation windows (validation.seq_len + 1 tokens each) per evaluation, the first N by index, "
        "divided between the data-parallel ranks: the same windows at any layout, local batch or resume",
        gt=0,
    )
    first_window: int = opt(
        0,
        "tokens data: the first validation window scored (windows first_window .. first_window + windows - 1); a "
        "study's confirmation runs score windows its selection runs did not",
        ge=0,
    )
    dataset: Optional[str] = opt(
        None, "validation data: sample, c4, text or tokens; unset (or the training data): its held-out split"
    )
    dataset_path: Optional[str] = opt(None, "local file or folder of validation data (like training.dataset_path)")
    batch_size: Optional[int] = opt(
        None, "sequences per data-parallel rank per batch; unset: training.batch_size", gt=0
    )
    seq_len: Optional[int] = opt(None, "tokens per sequence, at most training.seq_len; unset: training.seq_len", gt=0)
    held_out_every: int = opt(
        20,
        "about 1 in N documents of the training data (by a hash of the text; for tokens data every N-th window) "
        "is held out: never trained on, even with validation off; 0 trains on every document",
        ge=0,
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "log and record metrics every N steps", gt=0)
    enable_tensorboard: bool = opt(True, "write TensorBoard event files")
    save_tb_folder: str = opt("tb", "TensorBoard folder inside job.dump_folder")
    rank_0_only: bool = opt(
        True, "only rank 0 writes TensorBoard and metrics.jsonl; false: every rank writes its own (subfolder rank_N)"
    )
    enable_color_printing: bool = opt(False, "colour the per-step log line (ANSI escape codes)")
    health_freq: int = opt(
        50,
        "every N steps, log optimizer health per weight group (gradient norm, update RMS, update/weight ratio, "
        "weight norm, largest attention logit) and count loss spikes (docs/telemetry.md); 0: off, at no cost",
        ge=0,
    )
    health_max_layers: int = opt(
        16, "health per layer for models of at most this many layers; deeper models: per weight role only", ge=0
    )
    loss_spike_factor: float = opt(
        2.0, "a step's loss counts as a spike when above this factor times the running median loss", gt=1.0
    )
    loss_spike_window: int = opt(100, "steps in the running median that loss spikes are measured against", gt=0)
    enable_wandb: bool = opt(False, "also log to Weights & Biases (pip install -e '.[wandb]'), from global rank 0")
    wandb_project: str = opt("torchtitan", "Weights & Biases project")
    wandb_entity: Optional[str] = opt(None, "Weights & Biases entity (team or user); unset: your default entity")
    wandb_run_name: Optional[str] = opt(
        None, "Weights & Biases run name; unset: the run folder's name (in a study, the cell's run name)"
    )
    wandb_group: Optional[str] = opt(None, "Weights & Biases group; unset: none (in a study, the study's name)")


@dataclass
class Checkpoint:
    enable_checkpoint: bool = opt(False, "save and resume checkpoints")
    folder: Optional[str] = opt(
        None,
        "checkpoint folder, relative to job.dump_folder unless absolute; unset: checkpoint/<optimizer state>, the "
        "optimizer's name plus each option that shapes its state and is not at its default (e.g. "
        "checkpoint/AdamMini-state_dtype=bfloat16), so runs whose optimizer states differ never share checkpoints",
    )
    interval_type: str = opt(
        "steps",
        "unit of checkpoint.interval: steps, or seconds of wall time since the last save (rank 0's clock decides "
        "for all ranks)",
        choices=("steps", "seconds"),
    )
    interval: int = opt(
        500, "save every N steps, or N seconds with interval_type = seconds (and at the last step)", gt=0
    )
    keep_latest_k: int = opt(0, "keep only the newest k checkpoints; 0 keeps all", ge=0)
    async_mode: str = opt(
        "disabled",
        "disabled, async (full checkpoints are written by a background thread) or async_with_pinned_mem (async, "
        "staging into pinned CPU buffers kept from one save to the next: faster copies from the GPU); the weights "
        "export is always written at once",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    load_step: int = opt(-1, "resume from this step; -1 resumes from the latest complete checkpoint", ge=-1)
    export_dtype: str = opt(
        "float32",
        "dtype of the final weights-only export (needs model_weights_only or last_save_in_hf)",
        choices=("float32", "bfloat16", "float16"),
    )
    model_weights_only: bool = opt(False, "at the end, export model weights only (in export_dtype)")
    initial_load_path: Optional[str] = opt(
        None,
        "when checkpoint.folder holds no checkpoint yet, start from this one (a step-N folder, or a folder of "
        "them: the latest), e.g. another optimizer's run",
    )
    initial_load_model_only: bool = opt(
        True, "from initial_load_path load the model weights only: optimizer, lr schedule, data and step start fresh"
    )
    initial_load_in_hf: bool = opt(
        False,
        "initial_load_path is a Hugging Face Llama folder (config.json + model.safetensors or a sharded index): "
        "start from its weights",
    )
    last_save_in_hf: bool = opt(
        False,
        "after the last step, write the weights as a Hugging Face Llama folder (step-N-hf: config.json + "
        "safetensors in export_dtype) that transformers loads",
    )
    create_seed_checkpoint: bool = opt(
        False,
        "write the initial state as step-0 in checkpoint.folder and stop without training (needs enable_checkpoint "
        "and an empty folder); a later run resumes from it on any number of ranks",
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "activation checkpointing: none, full or selective", choices=("none", "full", "selective"))
    selective_ac_option: str = opt("2", "selective: 'op' for the op-based policy, or k to checkpoint every k-th layer")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "write torch profiler traces")
    save_traces_folder: str = opt("profile_traces", "trace folder inside job.dump_folder")
    profile_freq: int = opt(10, "profile one step every N steps", gt=0)
    enable_memory_snapshot: bool = opt(False, "write CUDA memory snapshots (GPU only)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder inside job.dump_folder")


@dataclass
class Float8:
    enable_float8_linear: bool = opt(False, "torchao float8 linears (needs a CUDA GPU with compute capability >= 8.9)")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300,
        "seconds a rank waits for the others in the setup of the default process group and in every collective on "
        "it and on the checkpoint's gloo group, before the job fails; sub-groups of a multi-dimensional device mesh "
        "keep torch's default (10 min NCCL, 30 min gloo)",
        gt=0,
    )
    train_timeout_seconds: Optional[int] = opt(
        None,
        "after the first step, the timeout of the training collectives (the default group and the mesh's; "
        "checkpoint saves keep theirs); unset: init_timeout_seconds throughout",
        gt=0,
    )
    trace_buf_size: Optional[int] = opt(
        None, "entries of NCCL's flight recorder (sets TORCH_NCCL_TRACE_BUFFER_SIZE unless already set)", ge=0
    )


@dataclass
class MemoryEstimation:
    """Read by estimation.py only; train.py ignores this section."""

    world_size: int = opt(8, "estimation.py: number of ranks to simulate", gt=0)
    optimizers: str = opt(
        "AdamW,AdamMini,AdamMini:state_dtype=bfloat16,AdamMini8bit,AdamMini4bit,AdamW4bit,Muon",
        "estimation.py: comma-separated optimizers to estimate, each NAME or NAME:option=value[:option=value] "
        "with [optimizer] options (AdamMini:state_dtype=bfloat16)",
    )
    device: str = opt(
        "cuda",
        "estimation.py: training to simulate: cuda (mixed precision, as train.py on a GPU) or cpu (param_dtype "
        "throughout)",
        choices=("cuda", "cpu"),
    )
    vocab_size: int = opt(
        0,
        "estimation.py: vocabulary size; 0 takes the tokenizer's, or the flavor's when the tokenizer file is absent",
        ge=0,
    )
    json: Optional[str] = opt(
        None, "estimation.py: also write the estimate as JSON to this file ('-': JSON only, to stdout)"
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    loss: Loss = field(default_factory=Loss)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    profiling: Profiling = field(default_factory=Profiling)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)

    @classmethod
    def parse_args(cls, argv: Optional[list[str]] = None, *, prog: str = "train.py") -> "JobConfig":
        """Defaults, then ``--job.config_file`` (if given), then the other command-line overrides."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if "-h" in argv or "--help" in argv:
            print(help_text(cls, prog))
            raise SystemExit(0)
        overrides = _split_command_line(cls, argv)
        refuse_both_names((key for key, _ in overrides), "the command line")
        config = cls()
        # The last --job.config_file wins, like any other repeated option.
        config_file = next((v for k, v in reversed(overrides) if k == "job.config_file"), None)
        if config_file is not None:
            _apply_toml(config, config_file)
            config.job.config_file = config_file
        for key, raw in overrides:
            if key in LEGACY_KEYS:
                _set_from_toml(config, key, _legacy_value(raw))
                continue
            value = _from_string(key, _field_type(cls, key), raw)
            _set_from_toml(config, key, value)
        _check_ranges(config)
        config.validate()
        return config

    def validate(self) -> None:
        """Checks that span several keys; per-key ranges are checked from the field metadata."""
        from torchtitan.lr_scheduling import check_schedule, schedule_options  # torch-free, like this module
        from torchtitan.optim.settings import check_values

        check_values(self)
        t = self.training
        check_schedule(**schedule_options(t))
        if t.data_parallel_shard_degree == 0:
            raise UserError("training.data_parallel_shard_degree must be -1 (fill) or a positive integer")
        if t.dataset_path is not None and not os.path.exists(t.dataset_path):
            raise UserError(f"training.dataset_path '{t.dataset_path}' does not exist; point it at a file or folder")
        self._validate_validation()
        self._refuse_options_that_do_nothing()
        self._validate_loss()
        self._validate_metrics()
        initial = self.checkpoint.initial_load_path
        if initial is not None and not os.path.isdir(initial):
            raise UserError(
                f"checkpoint.initial_load_path '{initial}' is not a folder; point it at a checkpoint's step-N folder"
            )
        self._validate_checkpoint_additions()
        ac = self.activation_checkpoint
        if ac.mode == "selective" and ac.selective_ac_option != "op":
            if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
                raise UserError(
                    "activation_checkpoint.selective_ac_option must be 'op' or a positive integer k (every k-th layer)"
                )

    def _refuse_options_that_do_nothing(self) -> None:
        """An option set where it cannot act would make a run look other than it is: refuse it."""
        c, defaults = self.checkpoint, Checkpoint()  # [optimizer]'s own: torchtitan.optim.settings.check_values
        if c.export_dtype != defaults.export_dtype and not (c.model_weights_only or c.last_save_in_hf):
            raise UserError(
                "checkpoint.export_dtype sets the dtype of the weights exports, which are off; add "
                "--checkpoint.model_weights_only or --checkpoint.last_save_in_hf, or remove checkpoint.export_dtype"
            )
        if c.initial_load_model_only != defaults.initial_load_model_only and c.initial_load_path is None:
            raise UserError(
                "checkpoint.initial_load_model_only applies to checkpoint.initial_load_path, which is unset; set "
                "the path or remove the option"
            )
        t = self.training
        if t.data_seed != Training().data_seed and t.dataset != "tokens":
            raise UserError(
                f"training.data_seed orders pre-tokenized data, but training.dataset is '{t.dataset}' (read in its "
                "files' order); remove it, or pretokenize the data and use training.dataset 'tokens'"
            )
        if t.allow_data_change and not c.enable_checkpoint:
            raise UserError(
                "training.allow_data_change applies to resuming a checkpoint, which is off; add "
                "--checkpoint.enable_checkpoint or remove training.allow_data_change"
            )
        if c.async_mode != defaults.async_mode and not c.enable_checkpoint:
            raise UserError(
                f"checkpoint.async_mode {c.async_mode} applies to full checkpoints, which are off (the weights export "
                "is always written at once); add --checkpoint.enable_checkpoint or remove checkpoint.async_mode"
            )

    def _validate_checkpoint_additions(self) -> None:
        """Hugging Face import/export, time-based intervals and seed checkpoints."""
        c, norm = self.checkpoint, self.model.norm_type
        hf_keys = [
            key
            for key, on in (("initial_load_in_hf", c.initial_load_in_hf), ("last_save_in_hf", c.last_save_in_hf))
            if on
        ]
        if hf_keys and norm not in RMSNORM_TYPES:
            raise UserError(
                f"checkpoint.{hf_keys[0]} needs an RMSNorm model (Hugging Face Llama has no {norm}); set "
                "model.norm_type = 'rmsnorm'"
            )
        if c.initial_load_in_hf:
            if c.initial_load_path is None:
                raise UserError(
                    "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path: a Hugging Face folder"
                )
            if not c.initial_load_model_only:
                raise UserError(
                    "checkpoint.initial_load_in_hf loads model weights only; remove checkpoint.initial_load_model_only "
                    "= false"
                )
            if not os.path.isfile(os.path.join(c.initial_load_path, "config.json")):
                raise UserError(
                    f"checkpoint.initial_load_path '{c.initial_load_path}' has no config.json; point it at a Hugging "
                    "Face Llama folder"
                )
        if c.create_seed_checkpoint and not c.enable_checkpoint:
            raise UserError(
                "checkpoint.create_seed_checkpoint writes step-0 into checkpoint.folder; set enable_checkpoint"
            )
        if c.interval_type == "seconds" and not c.enable_checkpoint:
            raise UserError("checkpoint.interval_type = 'seconds' times checkpoint saves; set enable_checkpoint")
        t = self.training
        if t.data_parallel_type == "ddp" and t.data_parallel_replicate_degree > 1:
            raise UserError(
                "training.data_parallel_type = 'ddp' replicates over all data-parallel ranks; remove "
                "training.data_parallel_replicate_degree (or use fsdp with it for HSDP)"
            )

    def _validate_validation(self) -> None:
        t, v = self.training, self.validation
        if v.held_out_every == 1:
            raise UserError("validation.held_out_every 1 would hold out every document; use 0 (none) or 2 or more")
        if v.dataset_path is not None and not os.path.exists(v.dataset_path):
            raise UserError(f"validation.dataset_path '{v.dataset_path}' does not exist; point it at a file or folder")
        if not v.enable:
            return
        defaults = Validation()
        reads_tokens = (v.dataset or t.dataset) == "tokens"
        if reads_tokens and v.steps != defaults.steps:
            raise UserError(
                f"validation.steps counts batches of text data, but validation reads tokens data, scored by "
                f"validation.windows ({v.windows}: the same windows at any layout); remove validation.steps or set "
                "validation.windows"
            )
        if not reads_tokens and v.first_window:
            raise UserError(
                "validation.first_window numbers windows of tokens data, but validation reads "
                f"{v.dataset or t.dataset} data, scored by validation.steps; remove validation.first_window"
            )
        if not reads_tokens and v.windows != defaults.windows:
            raise UserError(
                f"validation.windows counts windows of tokens data, but validation reads {v.dataset or t.dataset} "
                "data, scored by validation.steps; remove validation.windows or set validation.steps"
            )
        if v.seq_len is not None and v.seq_len > t.seq_len:
            raise UserError(f"validation.seq_len {v.seq_len} exceeds training.seq_len {t.seq_len}; lower it")
        if v.seq_len is not None and v.seq_len % t.tensor_parallel_degree:
            raise UserError(
                f"training.tensor_parallel_degree {t.tensor_parallel_degree} does not divide validation.seq_len "
                f"{v.seq_len}; pick a length it divides"
            )

    def _validate_metrics(self) -> None:
        m, defaults = self.metrics, Metrics()
        wandb_keys = ("wandb_project", "wandb_entity", "wandb_run_name", "wandb_group")
        changed = [key for key in wandb_keys if getattr(m, key) != getattr(defaults, key)]
        if not m.enable_wandb and changed:
            raise UserError(f"metrics.{changed[0]} is set but metrics.enable_wandb is off; set enable_wandb or drop it")
        health_keys = ("health_max_layers", "loss_spike_factor", "loss_spike_window")
        changed = [key for key in health_keys if getattr(m, key) != getattr(defaults, key)]
        if m.health_freq == 0 and changed:
            raise UserError(
                f"metrics.{changed[0]} applies to optimizer health, which metrics.health_freq 0 turns off; set a "
                "health_freq or remove it"
            )
        if m.enable_wandb and importlib.util.find_spec("wandb") is None:
            raise UserError(f"metrics.enable_wandb needs the wandb package: {WANDB_INSTALL}")

    def _validate_loss(self) -> None:
        t, v = self.training, self.validation
        micro_batches = {"training": t.batch_size * t.seq_len}
        if v.enable:
            micro_batches["validation"] = (v.batch_size or t.batch_size) * (v.seq_len or t.seq_len)
        for what, tokens in micro_batches.items():
            if self.loss.num_chunks > tokens:
                raise UserError(
                    f"loss.num_chunks {self.loss.num_chunks} exceeds the {tokens} tokens of a {what} micro-batch "
                    "(batch_size x seq_len); lower it"
                )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self, header: str = "") -> str:
        """The whole resolved config as a TOML file that ``--job.config_file`` reads back to the same config: every
        key, unset ones (None, the default of every optional key) left out; ``header`` goes first as comments."""
        import tomli_w

        tables = {
            section: {key: value for key, value in values.items() if value is not None}
            for section, values in self.to_dict().items()
        }
        comments = "".join(f"# {line}\n" for line in header.splitlines())
        return comments + tomli_w.dumps(tables)


# ----------------------------------------------------------------------------------------------------------------
# Parsing helpers


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _keys(cls: type) -> dict[str, dataclasses.Field]:
    keys = {}
    for section, section_cls in _sections(cls).items():
        for f in dataclasses.fields(section_cls):
            keys[f"{section}.{f.name}"] = f
    return keys


def _field_type(cls: type, key: str) -> Any:
    section, name = key.split(".", 1)
    return typing.get_type_hints(_sections(cls)[section])[name]


def _unknown(kind: str, name: str, valid: list[str]) -> UserError:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the valid keys)"
    return UserError(f"unknown {kind} '{name}'{hint}")


def _check_key(cls: type, key: str) -> None:
    keys = _keys(cls)
    if key in keys:
        return
    section = key.split(".", 1)[0]
    if "." not in key or section not in _sections(cls):
        # A typo'd section: compare whole keys so that the suggestion is complete.
        raise _unknown("config key", key, list(keys))
    raise _unknown("config key", key, [k for k in keys if k.startswith(section + ".")])


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) for ``T`` or ``Optional[T]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _base_type(tp)
    return {bool: "bool", int: "int", float: "float", str: "str"}[base] + (" or none" if optional else "")


def _from_string(key: str, tp: Any, raw: str) -> Any:
    base, optional = _base_type(tp)
    if optional and raw.lower() in ("none", "null", ""):
        return None
    if base is bool:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
    else:
        try:
            return base(raw)
        except ValueError:
            pass
    raise UserError(f"{key} expects {_type_name(tp)}, got '{raw}'")


def _from_toml(key: str, tp: Any, value: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is str and optional and isinstance(value, str) and value.lower() == "none":
        return None
    if isinstance(value, base) and (base is bool or not isinstance(value, bool)):
        return value
    raise UserError(f"{key} expects {_type_name(tp)}, got {type(value).__name__} {value!r} in the config file")


def _apply_toml(config: JobConfig, path: str) -> None:
    if not os.path.isfile(path):
        raise UserError(f"config file '{path}' not found; pass an existing TOML file to --job.config_file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file '{path}' is not valid TOML: {e}") from None
    cls = type(config)
    sections = _sections(cls)
    refuse_both_names(
        (f"{s}.{name}" for s, t in zip(data, data.values()) if isinstance(t, dict) for name in t), f"'{path}'"
    )
    for section, table in data.items():
        if section not in sections and section not in LEGACY_SECTIONS:
            raise _unknown("config section", f"[{section}]", [f"[{s}]" for s in sections])
        if not isinstance(table, dict):
            raise UserError(f"'{section}' in '{path}' must be a table like [{section}]")
        for name, value in table.items():
            _set_from_toml(config, f"{section}.{name}", value)


def _set_from_toml(config: JobConfig, key: str, value: Any) -> None:
    """Set one key of a TOML file (or a parsed command-line value), torchtitan's 2024 keys translated."""
    cls = type(config)
    pairs = translate(key, value)
    for target, target_value in [(key, value)] if pairs is None else pairs:
        _check_key(cls, target)
        section, name = target.split(".", 1)
        setattr(getattr(config, section), name, _from_toml(target, _field_type(cls, target), target_value))


def _legacy_value(raw: str) -> Any:
    """A command-line value of a torchtitan 2024 key, read as TOML (true, 8, [], "text"), else as text."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _split_command_line(cls: type, argv: list[str]) -> list[tuple[str, str]]:
    """``--a.b v``, ``--a.b=v`` and bare boolean ``--a.b`` into (key, raw string) pairs."""
    pairs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}'; options look like --section.key value")
        key, has_value, raw = arg[2:].partition("=")
        if key in LEGACY_KEYS:
            base = str  # any value is read by _legacy_value; a bare flag (next is an option) means true
            if not has_value and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                has_value, raw = True, "true"
        else:
            _check_key(cls, key)
            base, _ = _base_type(_field_type(cls, key))
        if not has_value:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if base is bool and (nxt is None or nxt.lower() not in ("true", "false", "1", "0", "yes", "no")):
                raw = "true"
            elif nxt is None:
                raise UserError(f"--{key} needs a value")
            else:
                raw = nxt
                i += 1
        pairs.append((key, raw))
        i += 1
    return pairs


def set_option(config: JobConfig, key: str, raw: str) -> None:
    """Set ``section.key`` of ``config`` from a string, checked as a command-line value is (UserError if wrong)."""
    _check_key(type(config), key)
    section, name = key.split(".", 1)
    setattr(getattr(config, section), name, _from_string(key, _field_type(type(config), key), raw))
    _check_ranges(config)


def _check_ranges(config: JobConfig) -> None:
    for key, f in _keys(type(config)).items():
        section, name = key.split(".", 1)
        value = getattr(getattr(config, section), name)
        if value is None:
            continue
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), meta["choices"], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"{key} must be one of {', '.join(meta['choices'])}; got '{value}'{hint}")
        for check, ok, words in (
            ("gt", lambda v, b: v > b, "greater than"),
            ("ge", lambda v, b: v >= b, "at least"),
            ("lt", lambda v, b: v < b, "less than"),
            ("le", lambda v, b: v <= b, "at most"),
        ):
            if check in meta and not ok(value, meta[check]):
                raise UserError(f"{key} must be {words} {meta[check]}; got {value}")


def help_text(cls: type = JobConfig, prog: str = "train.py") -> str:
    lines = [
        f"usage: {prog} [--job.config_file FILE.toml] [--section.key value ...]",
        "",
        "Options come from defaults, then the TOML file, then the command line (booleans also as bare flags).",
    ]
    for section, section_cls in _sections(cls).items():
        lines.append(f"\n[{section}]")
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            kind = "{" + ",".join(choices) + "}" if choices else _type_name(hints[f.name]).upper()
            lines.append(f"  --{section}.{f.name} {kind}  (default: {default})")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
