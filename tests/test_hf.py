"""Hugging Face Llama weights in (checkpoint.initial_load_in_hf) and out (checkpoint.last_save_in_hf), checked
against transformers itself: a model made by transformers, and transformers reading what we export."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.helpers import DEBUG_RUN, TINY, batch, hf_job, job_config, materialize, meta_model, tiny_manager
from torchtitan import training
from torchtitan.checkpoint import hf
from torchtitan.config_manager import JobConfig
from torchtitan.errors import UserError
from torchtitan.parallelisms import ParallelDims
from torchtitan.preflight import preflight


def _transformers():
    """transformers (a [dev] dependency; no hub access is needed), imported only where used: the two-rank
    workers import this module and need not pay for it."""
    import transformers

    return transformers


def _hf_llama(folder, seed: int = 3, tie: bool = False, max_shard_size=None, args=TINY):
    """A random Llama made by transformers with the tiny model's shape, saved (float64) in ``folder``."""
    transformers = _transformers()
    config = transformers.LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **options)
    return model


def _loaded(tmp_path, folder, model=None):
    job = hf_job(str(tmp_path), initial_load_path=str(folder), initial_load_in_hf=True)
    model = materialize(meta_model()) if model is None else model
    manager = tiny_manager(model, job)
    assert manager.load()
    return model, manager, job


def test_first_training_loss_of_a_transformers_model_equals_its_loss_in_transformers(tmp_path):
    reference = _hf_llama(tmp_path / "hf")
    model, manager, job = _loaded(tmp_path, tmp_path / "hf")
    inputs, labels = batch()
    loss, _, updated = training.train_step(
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
    ours = training.init_model(training.build_model(config, args, ParallelDims(1, -1, 1, 1), None), "cpu", seed=1)
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


def test_published_llama3_8b_config_matches_our_8b_flavor_and_rope_scaling_is_refused(tmp_path):
    from torchtitan.models.llama import llama3_configs

    args = dataclasses.replace(llama3_configs["8B"], vocab_size=128256)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    hf.check_hf_config(str(tmp_path), args)
    llama31 = {**LLAMA3_8B_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(llama31))
    with pytest.raises(UserError, match="rope scaling llama3"):
        hf.check_hf_config(str(tmp_path), args)
