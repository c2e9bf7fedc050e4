"""The spawned worlds of the distributed parity tests (``parallel_worlds.py``): each family's test module (its
``FAMILY``: adam_mini, muon (Muon and NorMuon) or ademamix) spawns each world size it asks for once."""

from __future__ import annotations

import pytest

from tests.optim.parallel_worlds import one_process_runs, spawn


@pytest.fixture(scope="module")
def family(request) -> str:
    return request.module.FAMILY


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, family) -> str:
    """Where world2 saves the checkpoint that the one-process tests resume."""
    return str(tmp_path_factory.mktemp(f"{family}_dcp"))


@pytest.fixture(scope="module")
def world2(family, checkpoint_dir):
    return spawn(2, family, checkpoint_dir)


@pytest.fixture(scope="module")
def world4(family):
    return spawn(4, family, None)


@pytest.fixture(scope="module")
def world6(family):
    return spawn(6, family, None)


@pytest.fixture(scope="module")
def one_process(family):
    return one_process_runs(family)
