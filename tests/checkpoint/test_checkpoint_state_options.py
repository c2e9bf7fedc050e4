"""Options that shape the optimizer state (state_dtype, value_blocks, block_size, ...) keep checkpoints apart, and a
checkpoint of another state is refused in one line, with or without the job facts that name it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.helpers import job_config, tiny_manager, tiny_model
from torchtitan.checkpoint import CheckpointManager
from torchtitan.checkpoint.folders import resolve_folder
from torchtitan.checkpoint.safe_reading import METADATA_FILE
from torchtitan.errors import UserError
from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.optim.settings import OPTION_RULES, state_label

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


def test_every_optimizer_option_declares_whether_it_shapes_the_state():
    undeclared = {(kind.name, o) for kind in OPTIMIZERS.values() for o in kind.options if o not in OPTION_RULES}
    assert not undeclared, f"declare these in optim.settings.OPTION_RULES: {sorted(undeclared)}"
    assert OPTIMIZERS["AdamMini"].state_options == (
        "attn_out_blocks",
        "embedding_blocks",
        "mlp_blocks",
        "output_blocks",
        "state_dtype",
        "value_blocks",
    )
    assert OPTIMIZERS["AdamW8bit"].state_options == ("block_size",)


@pytest.mark.parametrize(
    "options, label",
    [
        (["--optimizer.name", "adam_mini"], "AdamMini"),
        # Unset and the value it stands for are one state; implementation and rounding shape no state.
        (["--optimizer.name", "AdamMini", "--optimizer.value_blocks", "per_row"], "AdamMini"),
        (["--optimizer.name", "AdamMini", "--optimizer.state_dtype", "float32"], "AdamMini"),
        (["--optimizer.name", "AdamMini", "--optimizer.implementation", "foreach"], "AdamMini"),
        (
            [
                "--optimizer.name",
                "AdamW8bit",
                "--optimizer.bf16_stochastic_round",
                "false",
                "--training.param_dtype",
                "bfloat16",
            ],
            "AdamW8bit",
        ),
        (
            [
                "--optimizer.name",
                "AdamMini",
                "--optimizer.value_blocks",
                "per_tensor",
                "--optimizer.state_dtype",
                "bfloat16",
            ],
            "AdamMini-state_dtype=bfloat16-value_blocks=per_tensor",
        ),
        (["--optimizer.name", "AdamMini8bit", "--optimizer.block_size", "64"], "AdamMini8bit-block_size=64"),
        (["--optimizer.name", "AdamW", "--optimizer.state_dtype", "bfloat16"], "AdamW-state_dtype=bfloat16"),
    ],
)
def test_default_folder_is_apart_for_each_optimizer_state(options, label):
    config = job_config("--job.dump_folder", "/dump", *options)
    assert state_label(config) == label
    assert resolve_folder(config) == os.path.join("/dump", "checkpoint", label)


def _manager(folder: str, *options: str) -> CheckpointManager:
    config = job_config(
        "--job.dump_folder",
        folder,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.folder",
        "ck",
        *options,
        "--optimizer.implementation",
        "foreach",  # no compile: this test is about the checkpoint
    )
    model = tiny_model(dtype=torch.float32)
    return tiny_manager(model, config)


def test_checkpoint_of_another_optimizer_state_is_one_line(tmp_path, monkeypatch):
    _manager(str(tmp_path), "--optimizer.name", "AdamMini").save(1, force=True)
    per_tensor = _manager(str(tmp_path), "--optimizer.name", "AdamMini", "--optimizer.value_blocks", "per_tensor")
    with pytest.raises(UserError) as caught:
        per_tensor.load()
    message = str(caught.value)
    assert "\n" not in message
    assert (
        "was written by AdamMini; this job uses AdamMini (value_blocks per_tensor); use another checkpoint.folder"
        in message
    )
    # A checkpoint without job facts (an earlier version's) is refused by the shapes of its tensors.
    monkeypatch.setattr(CheckpointManager, "_read_facts", lambda self, path, entries: None)
    with pytest.raises(UserError, match=r"entries of other shapes: optimizer\.state\.\S+: \(\d+, 1\) there, \(1, 1\)"):
        per_tensor.load()
    # The same state loads (explicit per_row is the unset value).
    assert _manager(str(tmp_path), "--optimizer.name", "AdamMini", "--optimizer.value_blocks", "per_row").load()


def test_nothing_to_resume_names_the_folder_earlier_versions_used_for_every_state(tmp_path, caplog):
    config = job_config(
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable_checkpoint",
        "--optimizer.name",
        "AdamMini",
        "--optimizer.state_dtype",
        "bfloat16",
        "--optimizer.implementation",
        "foreach",
    )
    model = tiny_model(dtype=torch.float32)
    manager = tiny_manager(model, config)
    assert manager.folder == os.path.join(str(tmp_path), "checkpoint", "AdamMini-state_dtype=bfloat16")
    earlier = os.path.join(str(tmp_path), "checkpoint", "AdamMini")
    caplog.clear()  # the manager's own "checkpoint: folder ..." line, logged when an earlier test set INFO
    with caplog.at_level(logging.WARNING):
        assert not manager.load()
    assert not [r for r in caplog.records if earlier in r.getMessage()]  # nothing there yet: nothing to say
    os.makedirs(os.path.join(earlier, "step-5"))
    with open(os.path.join(earlier, "step-5", METADATA_FILE), "w") as f:
        f.write("an earlier version's")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not manager.load()  # a warning, not a refusal: the folder may be the default state's
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{earlier} holds checkpoints of AdamMini (steps 5)" in warning
    assert warning.endswith(f"--checkpoint.folder {os.path.join('checkpoint', 'AdamMini')}")
