"""Hugging Face Llama weights in (checkpoint.initial_load_in_hf) and out (checkpoint.last_save_in_hf), checked
against transformers itself: a model made by transformers, and transformers reading what we export."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.helpers import (
    DEBUG_RUN,
    LLAMA31_TINY,
    LLAMA32_TINY,
    TINY,
    batch,
    hf_job,
    job_config,
    materialize,
    meta_model,
    tiny_manager,
)
from torchtitan.checkpoint import hf
from torchtitan.config.job_config import JobConfig
from torchtitan.config.preflight import preflight
from torchtitan.errors import UserError
from torchtitan.parallelisms import ParallelDims
from torchtitan.training.step import build_model, init_model, train_step


def _transformers():
    """transformers (a [dev] dependency; no hub access is needed), imported only where used: the two-rank
    workers import this module and need not pay for it."""
    import transformers

    return transformers


SHAPED = {"llama31": LLAMA31_TINY, "llama32": LLAMA32_TINY}
QK_SCALE = 30.0


def _rope_parameters(args):
    """transformers' rope_parameters for ``args``, written out here rather than by our exporter."""
    if args.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": args.rope_theta,
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def _hf_llama(folder, seed: int = 3, tie: bool = False, max_shard_size=None, args=TINY):
    """A random Llama made by transformers with the tiny model's shape, saved (float64) in ``folder``."""
    transformers = _transformers()
    tie = tie or args.enable_weight_tying
    config = transformers.LlamaConfig(
        rope_parameters=_rope_parameters(args),
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    if args.rope_scaling != "none":
        # Larger queries and keys: at transformers' init (std 0.02) attention is nearly uniform, whatever the RoPE.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(QK_SCALE)
                layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **options)
    return model


def _loaded(tmp_path, folder, model=None, args=TINY):
    job = hf_job(str(tmp_path), initial_load_path=str(folder), initial_load_in_hf=True)
    model = materialize(meta_model(args)) if model is None else model
    manager = tiny_manager(model, job)
    assert manager.load()
    return model, manager, job


def test_first_training_loss_of_a_transformers_model_equals_its_loss_in_transformers(tmp_path):
    reference = _hf_llama(tmp_path / "hf")
    model, manager, job = _loaded(tmp_path, tmp_path / "hf")
    inputs, labels = batch()
    loss, _, updated = train_step(
        model, manager.optimizers, iter([(inputs, labels)]), ParallelDims(1, -1, 1, 1), job, torch.device("cpu")
    )
    tokens = torch.cat([inputs, labels[:, -1:]], dim=1)
    with torch.no_grad():
        expected = reference(input_ids=tokens, labels=tokens).loss
    assert updated
    # transformers casts the logits to float32 for its loss; our loss is float64 throughout.
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_sharded_folder_with_tied_embeddings_loads(tmp_path):
    reference = _hf_llama(tmp_path / "hf", tie=True, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "hf" / hf.INDEX_FILE)
    model, _, _ = _loaded(tmp_path, tmp_path / "hf")
    inputs, _ = batch()
    with torch.no_grad():
        # transformers computes its rotary angles its own way in float32: differences of about 1e-7.
        torch.testing.assert_close(model(inputs), reference(inputs).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.output.weight, model.tok_embeddings.weight, rtol=0, atol=0)


def test_exported_weights_give_our_logits_in_transformers(tmp_path, monkeypatch):
    # Small files, so that the export is split in several with an index, as large models are.
    monkeypatch.setattr(hf, "MAX_FILE_BYTES", 40_000)
    _hf_llama(tmp_path / "hf")
    model, manager, _ = _loaded(tmp_path, tmp_path / "hf")
    manager.hf_export_enabled = True
    manager.save(1, force=True)
    manager.close()
    exported = tmp_path / "checkpoint" / "step-1-hf"
    assert len([name for name in os.listdir(exported) if name.endswith(".safetensors")]) > 1
    reread = _transformers().LlamaForCausalLM.from_pretrained(str(exported)).eval()
    assert reread.dtype == torch.float32  # checkpoint.export_dtype
    inputs, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(reread(inputs).logits.double(), model(inputs), rtol=1e-5, atol=1e-5)


def test_an_export_fsyncs_every_file_and_its_folder_before_it_is_published(tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "MAX_FILE_BYTES", 40_000)  # several weight files and an index
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def recording_fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def recording_rename(source, target):
        events.append(("rename", os.path.realpath(source)))
        return rename(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    manager = tiny_manager(materialize(meta_model()), hf_job(str(tmp_path)))
    manager.hf_export_enabled = True
    manager.save(1, force=True)
    manager.close()
    exported = tmp_path / "checkpoint" / "step-1-hf"
    names = sorted(os.listdir(exported))
    assert len([n for n in names if n.endswith(".safetensors")]) > 1 and "config.json" in names
    renamed = [i for i, (kind, path) in enumerate(events) if kind == "rename" and ".step-1-hf.tmp-" in path]
    assert len(renamed) == 1
    temporary = events[renamed[0]][1]
    synced = {path for kind, path in events[: renamed[0]] if kind == "fsync"}
    assert {os.path.join(temporary, name) for name in names} <= synced
    assert temporary in synced  # the folder's entries too


def test_a_config_json_of_another_shape_is_one_line_naming_both(tmp_path):
    _hf_llama(tmp_path / "hf", args=dataclasses.replace(TINY, n_layers=3))
    with pytest.raises(UserError) as error:
        hf.check_hf_config(str(tmp_path / "hf"), TINY)
    message = str(error.value)
    assert "\n" not in message and "3 layers" in message and "2 layers" in message


def test_hf_options_are_checked_up_front(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        job_config("--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf")
    with pytest.raises(UserError, match="RMSNorm"):
        job_config("--checkpoint.last_save_in_hf", "--model.norm_type", "layernorm")


def test_query_and_key_rows_round_trip():
    weight = torch.arange(48.0).reshape(12, 4)
    assert torch.equal(hf.rows_from_hf(hf.rows_to_hf(weight, 3), 3), weight)
    # Hugging Face pairs feature i with i + head_dim/2; we pair 2i with 2i+1: head 0's rows 0, 3, 1, 4, 2, 5.
    assert hf.rows_from_hf(weight, 2)[:6, 0].tolist() == [0.0, 12.0, 4.0, 16.0, 8.0, 20.0]


# ------------------------------------------------------------------------------------------------------------------
# Through train.py and preflight (the shared debug-model run exports its last step)


def _debug_run_export(debug_run) -> str:
    dump, _ = debug_run
    return str(dump / "checkpoint" / "AdamW" / "step-6-hf")


def test_train_py_exports_what_transformers_and_our_loader_agree_on(debug_run, tmp_path):
    exported = _debug_run_export(debug_run)
    reread = _transformers().LlamaForCausalLM.from_pretrained(exported).eval()
    config = JobConfig.parse_args(
        [*DEBUG_RUN, "--checkpoint.initial_load_path", exported, "--checkpoint.initial_load_in_hf"]
    )
    _, args, tokenizer = preflight(config, world_size=1)
    assert (reread.config.bos_token_id, reread.config.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    ours = init_model(build_model(config, args, ParallelDims(1, -1, 1, 1), None), "cpu", seed=1)
    assert tiny_manager(ours, config).load()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reread(tokens).logits, rtol=0, atol=1e-4)


def test_preflight_names_both_shapes_when_the_flavor_differs(debug_run):
    config = JobConfig.parse_args(
        [
            *DEBUG_RUN,
            "--model.flavor",
            "debugmodel_gqa",
            "--checkpoint.initial_load_path",
            _debug_run_export(debug_run),
            "--checkpoint.initial_load_in_hf",
        ]
    )
    with pytest.raises(UserError, match=r"16 heads \(16 key/value.*this job's model.*16 heads \(4 key/value"):
        preflight(config, world_size=1)


# Meta-Llama-3-8B's config.json as published (transformers 4.40 era: rope_theta at the top, no head_dim).
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "attention_bias": False,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# Llama-3.1-8B's and Llama-3.2-1B's config.json as published (the keys that describe the model).
LLAMA31_8B_CONFIG = {
    **LLAMA3_8B_CONFIG,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
LLAMA32_1B_CONFIG = {
    **LLAMA31_8B_CONFIG,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "head_dim": 64,
    "rope_scaling": {**LLAMA31_8B_CONFIG["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
}


def _flavor(name: str):
    from torchtitan.models.llama import llama3_configs

    return dataclasses.replace(llama3_configs[name], vocab_size=128256)


def _check(tmp_path, config: dict, flavor: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf.check_hf_config(str(tmp_path), _flavor(flavor))


@pytest.mark.parametrize(
    "config, flavor, wrong_flavor, named",
    [
        (LLAMA3_8B_CONFIG, "8B", "3.1-8B", "this job's model.*rope scaling llama3 \\(factor 8"),
        (
            LLAMA31_8B_CONFIG,
            "3.1-8B",
            "8B",
            "describes a Llama with .*rope scaling llama3 \\(factor 8, low/high frequency",
        ),
        (LLAMA32_1B_CONFIG, "3.2-1B", "3.1-8B", "factor 32"),
    ],
)
def test_published_config_json_matches_its_flavor_and_another_flavor_is_named(
    tmp_path, config, flavor, wrong_flavor, named
):
    _check(tmp_path, config, flavor)
    with pytest.raises(UserError, match=named):
        _check(tmp_path, config, wrong_flavor)


def test_the_untied_1b_flavor_loads_a_tied_folder_and_a_tied_model_refuses_an_untied_one(tmp_path):
    # "1B" (Llama 3.2 1B's shapes, untied, unscaled) keeps its meaning: llama3 scaling is named as the difference.
    with pytest.raises(UserError, match="rope scaling llama3"):
        _check(tmp_path, LLAMA32_1B_CONFIG, "1B")
    untied = {**LLAMA32_1B_CONFIG, "tie_word_embeddings": False}
    with pytest.raises(UserError, match="tie_word_embeddings false.*--model.enable_weight_tying false") as error:
        _check(tmp_path, untied, "3.2-1B")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "linear"])
def test_a_rope_type_we_do_not_implement_is_one_line_naming_it(tmp_path, rope_type):
    config = {**LLAMA31_8B_CONFIG, "rope_scaling": {"rope_type": rope_type, "factor": 4.0}}
    with pytest.raises(UserError, match=f"RoPE scaling '{rope_type}'") as error:
        _check(tmp_path, config, "3.1-8B")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flavor", ["3.1-8B", "3.1-70B", "3.2-1B", "3.2-3B"])
def test_scaled_rope_frequencies_equal_transformers(flavor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from torchtitan.models.llama.model import rope_frequencies

    args = _flavor(flavor)
    config = _transformers().LlamaConfig(
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        max_position_embeddings=131072,
        rope_parameters=_rope_parameters(args),
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    assert torch.equal(rope_frequencies(args), expected)
    # The scaling changes the low frequencies: the comparison is not of two unscaled tables.
    unscaled = rope_frequencies(dataclasses.replace(args, rope_scaling="none"))
    assert (unscaled[-1] / expected[-1]).item() == pytest.approx(args.rope_scaling_factor)


@pytest.mark.parametrize("shape", list(SHAPED))
def test_first_loss_of_a_scaled_or_tied_transformers_model_equals_its_loss_in_transformers(tmp_path, shape):
    args = SHAPED[shape]
    reference = _hf_llama(tmp_path / "hf", args=args)
    model, manager, job = _loaded(tmp_path, tmp_path / "hf", args=args)
    assert (model.output.weight is model.tok_embeddings.weight) == args.enable_weight_tying
    inputs, labels = batch()
    tokens = torch.cat([inputs, labels[:, -1:]], dim=1)
    with torch.no_grad():
        expected = reference(input_ids=tokens, labels=tokens).loss.item()
        # Without the scaling the same weights give another loss, many times the tolerance below away.
        unscaled = materialize(meta_model(dataclasses.replace(args, rope_scaling="none")))
        unscaled.load_state_dict(model.state_dict())
        assert abs(unscaled(inputs, labels=labels).item() - expected) > 20 * 1e-6 * expected
    loss, _, _ = train_step(
        model, manager.optimizers, iter([(inputs, labels)]), ParallelDims(1, -1, 1, 1), job, torch.device("cpu")
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("shape", list(SHAPED))
def test_an_exported_scaled_or_tied_model_loads_in_transformers_with_equal_logits(tmp_path, shape):
    args = SHAPED[shape]
    _hf_llama(tmp_path / "hf", args=args)
    model, manager, _ = _loaded(tmp_path, tmp_path / "hf", args=args)
    manager.hf_export_enabled = True
    manager.save(1, force=True)
    manager.close()
    exported = tmp_path / "checkpoint" / "step-1-hf"
    from safetensors.torch import load_file

    names = load_file(str(exported / "model.safetensors")).keys()
    assert ("lm_head.weight" in names) != args.enable_weight_tying
    reread = _transformers().LlamaForCausalLM.from_pretrained(str(exported)).eval()
    assert reread.config.tie_word_embeddings == args.enable_weight_tying
    assert reread.config.rope_parameters["rope_type"] == "llama3"
    assert reread.config.rope_parameters["factor"] == args.rope_scaling_factor
    inputs, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(reread(inputs).logits.double(), model(inputs), rtol=1e-5, atol=1e-5)
    hf.check_hf_config(str(exported), args)


# ------------------------------------------------------------------------------------------------------------------
# The continued-pretraining walk-through (docs/llama-3x-weights.md), with a tiny random Llama 3.2-shaped folder
# standing in for the download: the debug model's shape, tied and scaled as Llama 3.2 is, and a tokenizer.json.

STAND_IN_OPTIONS = [
    "--model.rope_scaling",
    "llama3",
    "--model.rope_scaling_factor",
    "32",
    "--model.enable_weight_tying",
]


def _stand_in_download(folder) -> None:
    from tests.helpers import hf_tokenizer_folder
    from torchtitan.models.llama import llama3_configs

    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=2256, rope_scaling="llama3", rope_scaling_factor=32.0
    )
    args = dataclasses.replace(args, enable_weight_tying=True)
    transformers = _transformers()
    config = transformers.LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=131072,
        rope_parameters=_rope_parameters(args),
        tie_word_embeddings=True,
        bos_token_id=2000,
        eos_token_id=2001,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    hf_tokenizer_folder(folder)


def test_continued_pretraining_walk_through_compares_adamw_and_adam_mini_from_the_same_weights(tmp_path):
    from tests import processes
    from tests.distributed import launch_env
    from tests.helpers import ROOT, by_step, metric_rows, run_dirs

    download = tmp_path / "Llama-3.2-1B"
    _stand_in_download(download)
    dump = tmp_path / "continued"
    env = launch_env(1, True, NGPU="1", FLAVOR="debugmodel", DUMP_FOLDER=str(dump), PYTHONPATH=str(ROOT))
    small = ["--training.seq_len", "32", "--training.batch_size", "2", "--training.steps", "2"]
    small += ["--training.warmup_steps", "1", "--metrics.log_freq", "1"]
    command = ["bash", str(ROOT / "scripts" / "continue_pretraining.sh"), str(download), *STAND_IN_OPTIONS, *small]
    proc = processes.run(command, cwd=tmp_path, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count("started from the Hugging Face weights") == 2
    first = {}
    for optimizer in ("AdamW", "AdamMini"):
        (run,) = run_dirs(dump, optimizer)
        losses = by_step(metric_rows(run))
        assert sorted(losses) == [1, 2]
        first[optimizer] = losses[1]
        assert any(line.startswith(run.name) or run.name in line for line in proc.stdout.splitlines())
    # The same weights, tokenizer and data: the first loss (before any update) is the same for both optimizers.
    assert first["AdamW"] == first["AdamMini"]
    assert (dump / "compare.png").stat().st_size > 0
