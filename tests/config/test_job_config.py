import sys
from pathlib import Path

import pytest

from tests import processes
from torchtitan.config.job_config import JobConfig
from torchtitan.config.parsing import help_text
from torchtitan.config.preflight import preflight
from torchtitan.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def write_toml(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_command_line(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\nbatch_size = 3\n[optimizer]\nlr = 1\n")
    config = JobConfig.parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert config.training.steps == 9  # command line beats TOML
    assert config.training.batch_size == 3  # TOML beats default
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)  # int widened to float
    assert config.training.seq_len == JobConfig().training.seq_len  # default kept
    assert config.job.config_file == path


def test_command_line_before_config_file_still_wins(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\n")
    config = JobConfig.parse_args(["--training.steps=11", f"--job.config_file={path}"])
    assert config.training.steps == 11


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.compile"], True),
        (["--training.compile", "true"], True),
        (["--training.compile=false"], False),
        (["--training.compile", "false"], False),
        (["--training.compile", "--training.steps", "3"], True),
    ],
)
def test_boolean_flags(argv, expected):
    assert JobConfig.parse_args(argv).training.compile is expected


def test_options_that_act_are_accepted():
    config = JobConfig.parse_args(
        [
            "--optimizer.bf16_stochastic_round=true",
            "--training.param_dtype=bfloat16",
            "--checkpoint.export_dtype=bfloat16",
            "--checkpoint.model_weights_only",
            "--checkpoint.async_mode=async",
            "--checkpoint.enable_checkpoint",
        ]
    )
    assert config.optimizer.bf16_stochastic_round and config.checkpoint.async_mode == "async"


def test_optional_values_accept_none():
    config = JobConfig.parse_args(["--optimizer.implementation", "fused", "--training.dataset_path", "none"])
    assert config.optimizer.implementation == "fused"
    assert config.training.dataset_path is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stpes", "3"], "unknown config key 'training.stpes' (did you mean 'training.steps'?)"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'?"),
        (["--nonsense.key", "3"], "unknown config key 'nonsense.key'"),
        (["--training.steps", "three"], "training.steps expects int, got 'three'"),
        (["--training.steps", "1.5"], "training.steps expects int"),
        (["--optimizer.lr", "fast"], "optimizer.lr expects float"),
        (["--training.compile", "maybe"], "unexpected argument 'maybe'"),
        (["--training.compile=maybe"], "training.compile expects bool"),
        (["--training.steps"], "--training.steps needs a value"),
        (["--training.steps", "0"], "training.steps must be greater than 0"),
        (["--optimizer.beta1", "1.0"], "optimizer.beta1 must be in [0, 1)"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be at least 0; got -1.0"),
        (["--optimizer.eps", "-1e-8"], "optimizer.eps must be at least 0"),
        (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be at least 0; got -0.1"),
        (["--optimizer.implementation", "fusd"], "did you mean 'fused'?"),
        (["--training.data_parallel_shard_degree", "0"], "data_parallel_shard_degree must be -1"),
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
            "'op' or a positive integer",
        ),
        (["--job.config_file", "/no/such/file.toml"], "config file '/no/such/file.toml' not found"),
        (["--training.dataset_path", "/no/such/data"], "training.dataset_path '/no/such/data' does not exist"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        # Options that would change nothing.
        (["--optimizer.bf16_stochastic_round", "true"], "but training.param_dtype is float32"),
        (["--checkpoint.export_dtype", "bfloat16"], "the weights exports, which are off"),
        (["--checkpoint.initial_load_model_only", "false"], "checkpoint.initial_load_path, which is unset"),
        (["--checkpoint.async_mode", "async", "--checkpoint.model_weights_only"], "full checkpoints, which are off"),
    ],
)
def test_bad_command_line(argv, message):
    with pytest.raises(UserError) as info:
        JobConfig.parse_args(argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[trainig]\nsteps = 3\n", "unknown config section '[trainig]' (did you mean '[training]'?)"),
        ("[training]\nstpes = 3\n", "did you mean 'training.steps'?"),
        ('[training]\nsteps = "3"\n', "training.steps expects int, got str '3'"),
        ("[training]\ncompile = 1\n", "training.compile expects bool"),
        ("[training]\nsteps = 2.5\n", "training.steps expects int"),
        ("[training]\nsteps = true\n", "training.steps expects int"),
        ("[optimizer]\nbeta2 = 1.5\n", "optimizer.beta2 must be in [0, 1)"),
        ("training = 3\n", "must be a table like [training]"),
        ("[training\nsteps = 3\n", "is not valid TOML"),
    ],
)
def test_bad_toml(tmp_path, toml, message):
    path = write_toml(tmp_path, toml)
    with pytest.raises(UserError) as info:
        JobConfig.parse_args(["--job.config_file", path])
    assert message in str(info.value)


def test_help_lists_every_option_with_default_and_description():
    text = help_text(JobConfig)
    config = JobConfig()
    for section, values in config.to_dict().items():
        for key, default in values.items():
            line = next(row for row in text.splitlines() if row.strip().startswith(f"--{section}.{key} "))
            assert f"(default: {default})" in line
    assert "peak learning rate" in text


def test_shipped_configs_parse_and_those_marked_for_integration_tests_pass_preflight():
    marked = []
    for path in sorted((ROOT / "train_configs").glob("*.toml")):
        config = JobConfig.parse_args(["--job.config_file", str(path)])
        if config.job.use_for_integration_test:
            preflight(config, world_size=1)
            marked.append(path.name)
    assert "debug_model.toml" in marked


def test_help_from_the_command_line():
    # A mistake on train.py's command line, from a real process: tests/training/test_train.py.
    ok = processes.run([sys.executable, "train.py", "--help"], cwd=ROOT, timeout=300)
    assert ok.returncode == 0 and "--optimizer.name" in ok.stdout and "--training.max_skipped_steps" in ok.stdout


def test_model_options_replace_the_flavors_rope_scaling_and_tying():
    from torchtitan.config.preflight import model_args_for

    def args(*argv):
        return model_args_for(JobConfig.parse_args(list(argv)), 2256)

    assert (args().rope_scaling, args().enable_weight_tying) == ("none", False)
    scaled = args("--model.rope_scaling", "llama3", "--model.rope_scaling_factor", "16", "--model.enable_weight_tying")
    assert (scaled.rope_scaling, scaled.rope_scaling_factor, scaled.enable_weight_tying) == ("llama3", 16.0, True)
    assert (scaled.rope_low_freq_factor, scaled.rope_high_freq_factor, scaled.rope_original_max_seq_len) == (1, 4, 8192)
    published = args("--model.flavor", "3.2-1B", "--model.enable_weight_tying", "false")
    assert (published.rope_scaling_factor, published.enable_weight_tying) == (32.0, False)
    unscaled = args("--model.flavor", "3.2-1B", "--model.rope_scaling", "none")
    assert unscaled.rope_scaling == "none"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model.rope_scaling_factor", "4"], "model.rope_scaling_factor applies to llama3 RoPE scaling"),
        (["--model.flavor", "3.1-8B", "--model.rope_scaling", "none", "--model.rope_high_freq_factor", "2"], "'none'"),
        (["--model.rope_scaling", "yarn"], "model.rope_scaling"),
        (["--model.rope_scaling", "llama3", "--model.rope_low_freq_factor", "4"], "0 < low < high"),
        (["--model.rope_scaling_factor", "0.5"], "model.rope_scaling_factor"),
    ],
)
def test_rope_options_that_cannot_act_or_are_wrong_are_one_line(argv, fragment):
    from torchtitan.config.preflight import model_args_for

    with pytest.raises(UserError, match=fragment) as error:
        model_args_for(JobConfig.parse_args(argv), 2256)
    assert "\n" not in str(error.value)
