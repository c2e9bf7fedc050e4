"""torchtitan's 2024 TOML format: every key honoured with its meaning, or refused in one line saying what to use."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import ROOT, job_config
from torchtitan.config.job_config import JobConfig
from torchtitan.config.legacy import LEGACY_KEYS
from torchtitan.config.preflight import preflight
from torchtitan.errors import UserError
from torchtitan.parallelisms import ParallelDims

# torchtitan's train_configs/llama3_8b.toml as of late July 2024 (its 64-GPU preset), written out here as data.
LLAMA3_8B_2024 = textwrap.dedent(
    """
    # torchtitan Config.toml
    [job]
    dump_folder = "./outputs"
    description = "Llama 3 8B training"

    [profiling]
    enable_profiling = true
    save_traces_folder = "profile_trace"
    profile_freq = 100

    [metrics]
    log_freq = 10
    enable_tensorboard = true
    save_tb_folder = "tb"

    [model]
    name = "llama3"
    flavor = "8B"
    norm_type = "rmsnorm"  # layernorm / np_layernorm / rmsnorm / compiled_rmsnorm / fused_rmsnorm
    tokenizer_path = "./torchtitan/datasets/tokenizer/original/tokenizer.model"

    [optimizer]
    name = "AdamW"
    lr = 3e-4

    [training]
    batch_size = 1
    seq_len = 8192
    warmup_steps = 200  # lr scheduler warm up
    max_norm = 1.0  # grad norm clipping
    steps = 1000
    data_parallel_degree = -1
    tensor_parallel_degree = 1
    compile = false
    dataset = "c4"

    [experimental]
    pipeline_parallel_degree = 1

    [checkpoint]
    enable_checkpoint = false
    folder = "checkpoint"
    interval_type = "steps"
    interval = 500
    model_weights_only = false
    export_dtype = "float32"
    async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

    [activation_checkpoint]
    mode = 'selective'  # ['none', 'selective', 'full']
    selective_ac_option = 'op'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

    [float8]
    enable_float8_linear = false
    """
)

# Every other key of the 2024 format, at a value it could hold, as a TOML table -> {our key: the value it has here}.
OTHER_2024_KEYS = textwrap.dedent(
    """
    [job]
    use_for_integration_test = false
    [metrics]
    enable_color_printing = true
    rank_0_only = false
    [optimizer]
    fused = true
    [training]
    enable_loss_parallel = false
    data_parallel_type = "fsdp"
    mixed_precision_param = "bfloat16"
    mixed_precision_reduce = "float32"
    gc_freq = 50
    enable_float8_linear = false
    enable_fsdp_float8_all_gather = false
    precompute_float8_dynamic_scale_for_fsdp = false
    [experimental]
    enable_async_tensor_parallel = false
    pipeline_parallel_degree = 1
    pipeline_parallel_split_points = []
    pipeline_parallel_schedule = "1f1b"
    pipeline_parallel_split_mode = "manual"
    enable_compiled_autograd = false
    [checkpoint]
    enable_checkpoint = true
    interval_type = "seconds"
    async_mode = "async_with_pinned_mem"
    create_seed_checkpoint = false
    keep_latest_k = 2
    [float8]
    enable_fsdp_float8_all_gather = false
    precompute_float8_dynamic_scale_for_fsdp = false
    scaling_type_input = "dynamic"
    scaling_type_weight = "dynamic"
    scaling_type_grad_output = "dynamic"
    [comm]
    init_timeout_seconds = 300
    train_timeout_seconds = 100
    trace_buf_size = 20000
    [memory_estimation]
    enabled = false
    disable_fake_mode = false
    """
)


def _load(tmp_path, text: str, *argv: str) -> JobConfig:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return JobConfig.parse_args(["--job.config_file", str(path), *argv])


def test_llama3_8b_config_of_2024_loads_unchanged_through_preflight(tmp_path):
    # Only what depends on this machine is overridden: the tokenizer file and the (offline) data.
    config = _load(
        tmp_path,
        LLAMA3_8B_2024,
        "--model.tokenizer_path",
        str(ROOT / "assets/tokenizer/tiktoken_test.model"),
        "--training.dataset",
        "sample",
    )
    assert config.model.norm_type == "rmsnorm" and config.checkpoint.interval_type == "steps"
    assert config.training.data_parallel_shard_degree == -1 and config.activation_checkpoint.selective_ac_option == "op"
    parallel_dims, model_args, _ = preflight(config, world_size=64)
    assert (parallel_dims.dp_shard, parallel_dims.tp) == (64, 1)
    assert (model_args.dim, model_args.n_layers, model_args.max_seq_len) == (4096, 32, 8192)


def test_every_other_2024_key_is_honoured(tmp_path):
    config = _load(tmp_path, OTHER_2024_KEYS)
    assert config.metrics.enable_color_printing and not config.metrics.rank_0_only
    assert config.optimizer.implementation == "fused"
    assert config.training.disable_loss_parallel and config.training.gc_freq == 50
    assert config.checkpoint.interval_type == "seconds" and config.checkpoint.async_mode == "async_with_pinned_mem"
    assert not config.float8.enable_float8_linear
    assert (config.comm.train_timeout_seconds, config.comm.trace_buf_size) == (100, 20000)


def test_renamed_keys_from_the_command_line_too():
    config = JobConfig.parse_args(
        ["--training.data_parallel_degree", "2", "--training.enable_float8_linear=false", "--optimizer.fused"]
    )
    assert config.training.data_parallel_shard_degree == 2 and config.optimizer.implementation == "fused"
    assert not JobConfig.parse_args(["--training.enable_loss_parallel", "true"]).training.disable_loss_parallel


@pytest.mark.parametrize(
    "table, line, words",
    [
        ("experimental", "pipeline_parallel_degree = 2", "pipeline parallelism"),
        ("experimental", 'pipeline_parallel_split_points = ["layers.4"]', "pipeline parallelism"),
        ("experimental", "pipeline_parallel_microbatches = 4", "pipeline parallelism"),
        ("experimental", "enable_async_tensor_parallel = true", "tensor_parallel_degree"),
        ("experimental", "enable_compiled_autograd = true", "training.compile"),
        ("float8", "enable_fsdp_float8_all_gather = true", "float8.enable_float8_linear"),
        ("training", "precompute_float8_dynamic_scale_for_fsdp = true", "float8.enable_float8_linear"),
        ("float8", 'scaling_type_weight = "delayed"', "'dynamic'"),
        ("memory_estimation", "enabled = true", "estimation.py"),
        ("training", 'dataset = "c4_mini"', "'sample'"),
        ("model", 'name = "llama2"', "llama3"),
    ],
)
def test_features_not_here_are_refused_in_one_line_saying_what_to_use(tmp_path, table, line, words):
    with pytest.raises(UserError) as error:
        _load(tmp_path, f"[{table}]\n{line}\n")
    message = str(error.value)
    assert "\n" not in message and "unknown" not in message and words in message


@pytest.mark.parametrize(
    "table, line",
    [
        ("training", 'enable_loss_parallel = "false"'),
        ("training", "enable_loss_parallel = 0"),
        ("optimizer", 'fused = "false"'),
        ("optimizer", "fused = 1"),
    ],
)
def test_renamed_bool_keys_refuse_other_values_in_one_line(tmp_path, table, line):
    with pytest.raises(UserError) as error:
        _load(tmp_path, f"[{table}]\n{line}\n")
    message, key = str(error.value), f"{table}.{line.split(' = ')[0]}"
    assert "\n" not in message and f"{key} expects bool" in message and "true or false" in message


def test_renamed_bool_keys_refuse_other_values_from_the_command_line_too():
    with pytest.raises(UserError, match="training.enable_loss_parallel expects bool, got str 'maybe'"):
        JobConfig.parse_args(["--training.enable_loss_parallel", "maybe"])


@pytest.mark.parametrize(
    "lines",
    [
        ("data_parallel_degree = 2", "data_parallel_shard_degree = 4"),
        ("data_parallel_shard_degree = 4", "data_parallel_degree = 2"),
    ],
)
def test_a_2024_key_and_its_current_name_in_one_file_are_refused_in_one_line(tmp_path, lines):
    with pytest.raises(UserError) as refused:
        _load(tmp_path, "[training]\n" + "\n".join(lines) + "\n")
    message = str(refused.value)
    assert "\n" not in message and "training.data_parallel_degree" in message
    assert "keep only training.data_parallel_shard_degree" in message


def test_a_2024_key_and_its_current_name_on_one_command_line_are_refused_in_one_line():
    argv = ["--training.enable_loss_parallel", "false", "--training.disable_loss_parallel", "false"]
    with pytest.raises(UserError, match="the command line sets both training.enable_loss_parallel .* keep only"):
        JobConfig.parse_args(argv)


def test_the_command_line_still_overrides_a_2024_key_of_the_file(tmp_path):
    config = _load(tmp_path, "[training]\ndata_parallel_degree = 2\n", "--training.data_parallel_shard_degree", "4")
    assert config.training.data_parallel_shard_degree == 4


def test_ddp_replicates_over_the_data_parallel_ranks():
    config = job_config("--training.data_parallel_type", "ddp", "--training.tensor_parallel_degree", "2")
    dims = ParallelDims.from_job_config(config, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (4, 1, 2)
    with pytest.raises(UserError, match="data_parallel_replicate_degree"):
        job_config("--training.data_parallel_type", "ddp", "--training.data_parallel_replicate_degree", "2")


def test_docs_table_lists_every_2024_key():
    section = (ROOT / "docs" / "torchtitan-2024-configs.md").read_text()
    new_keys = (
        "model.norm_type",
        "training.data_parallel_type",
        "training.gc_freq",
        "checkpoint.interval_type",
        "checkpoint.create_seed_checkpoint",
        "metrics.rank_0_only",
        "metrics.enable_color_printing",
        "job.use_for_integration_test",
        "comm.train_timeout_seconds",
        "comm.trace_buf_size",
    )
    for key in (*LEGACY_KEYS, *new_keys):
        assert f"`{key}`" in section, key


def test_train_timeout_applies_to_the_default_group_and_the_mesh_after_a_barrier(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.distributed.collectives import set_collective_timeout

    calls = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
        monkeypatch.setattr(
            dist.distributed_c10d, "_set_pg_timeout", lambda timeout, group: calls.append((timeout, group))
        )
        set_collective_timeout(30, mesh)
        expected_groups = [dist.group.WORLD, *mesh.get_all_groups()]
    finally:
        dist.destroy_process_group()
    assert calls[0] == "barrier"
    assert [group for _, group in calls[1:]] == expected_groups and len(expected_groups) == 3
    assert {timeout.total_seconds() for timeout, _ in calls[1:]} == {30.0}
