"""A resume trains on with the job's optimizer settings, never the checkpoint's, for every optimizer.

The checkpoint says where a run stopped (weights, moments, step); the job says how to go on: betas, eps, weight
decay, and Muon's momentum, Nesterov and Newton–Schulz steps, on every param group (Muon's AdamW part included).
Each setting that differs from the checkpoint's is logged, in one line.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import job_config, set_synthetic_grads, tiny_manager, tiny_model, weights
from torchtitan.optim import build_optimizers
from torchtitan.optim.container import job_settings

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

ADAM_SETTINGS = ("--optimizer.beta1", "0.8", "--optimizer.beta2", "0.9", "--optimizer.eps", "1e-6")
# Other than the defaults the checkpoint is written with, for each optimizer family.
OTHER_SETTINGS = {
    "AdamW": (*ADAM_SETTINGS, "--optimizer.weight_decay", "0.0"),
    "AdamMini": (*ADAM_SETTINGS, "--optimizer.weight_decay", "0.0"),
    "AdamMini8bit": (*ADAM_SETTINGS, "--optimizer.weight_decay", "0.0"),
    "Muon": (
        *ADAM_SETTINGS,
        "--optimizer.weight_decay",
        "0.0",
        "--optimizer.momentum",
        "0.5",
        "--optimizer.nesterov",
        "false",
        "--optimizer.ns_steps",
        "2",
    ),
}
# What the log line says for each (the checkpoint's value, then the job's).
LOGGED = {
    "AdamW": ("betas [0.9, 0.95] -> [0.8, 0.9]", "eps 1e-08 -> 1e-06", "weight_decay 0.1 -> 0.0"),
    "Muon": ("momentum 0.95 -> 0.5", "nesterov True -> False", "ns_steps 5 -> 2", "betas [0.9, 0.95] -> [0.8, 0.9]"),
}


def settings_job(dump_folder, name: str, *argv: str):
    exact = ("--optimizer.ns_dtype", "float64") if name == "Muon" else ()  # Newton–Schulz exact in float64
    return job_config(
        "--optimizer.name",
        name,
        *exact,
        *argv,
        job={"dump_folder": str(dump_folder)},
        training={"steps": 3, "param_dtype": "float64"},
        checkpoint={"enable_checkpoint": True, "folder": "checkpoint"},
    )


def plain(settings: list[list[dict]]) -> list[list[dict]]:
    """Param-group settings as comparable plain data (torchao keeps its lr as a tensor)."""
    convert = {torch.Tensor: lambda v: v.tolist(), tuple: list}
    return [
        [{k: convert.get(type(v), lambda v: v)(v) for k, v in group.items()} for group in groups] for groups in settings
    ]


def resumed(job):
    """A fresh model and optimizer of ``job``, resumed from the job's checkpoint folder."""
    model = tiny_model(seed=1)  # other weights than the checkpoint's: the load replaces them
    manager = tiny_manager(model, job)
    assert manager.load()
    return model, manager.optimizers


@pytest.mark.parametrize("name", list(OTHER_SETTINGS))
def test_a_resume_trains_on_with_the_jobs_optimizer_settings(name, tmp_path, caplog):
    saved_job = settings_job(tmp_path, name)
    job = settings_job(tmp_path, name, *OTHER_SETTINGS[name])
    model = tiny_model()
    writer = tiny_manager(model, saved_job)
    set_synthetic_grads(model, 0)
    writer.optimizers.step()
    writer.save(1, force=True)
    writer.close()

    with caplog.at_level(logging.INFO, logger="torchtitan"):
        model, optimizers = resumed(job)
    wanted = [job_settings(optimizer) for optimizer in build_optimizers([tiny_model()], job)]
    assert plain([job_settings(optimizer) for optimizer in optimizers]) == plain(wanted)
    lines = [r.getMessage() for r in caplog.records if "replace the checkpoint's" in r.getMessage()]
    assert len(lines) == 1
    for change in LOGGED.get(name, LOGGED["AdamW"]):
        assert change in lines[0], lines[0]

    # The next step is the step of the checkpoint's state under the job's settings (and they do change it).
    def next_step(model, optimizers):
        set_synthetic_grads(model, 1)
        optimizers.step()
        return weights(model)

    resumed_weights = next_step(model, optimizers)
    set_by_hand, by_hand = resumed(saved_job)
    for optimizer, settings in zip(by_hand, wanted):
        for group, values in zip(optimizer.param_groups, settings):
            group.update(values)
    expected = next_step(set_by_hand, by_hand)
    unchanged = next_step(*resumed(saved_job))
    for key, value in expected.items():
        assert torch.equal(resumed_weights[key], value), key
    assert any(not torch.equal(resumed_weights[key], value) for key, value in unchanged.items())
