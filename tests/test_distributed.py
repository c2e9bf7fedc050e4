"""tests/distributed.py's ranks: forked from a fork server, each sees the environment its caller had at run_workers."""

import os

from tests.distributed import run_workers

VARIABLE = "TORCHTITAN_TEST_RANK_ENVIRONMENT"


def _seen(rank: int, world_size: int) -> tuple[str | None, str]:
    return os.environ.get(VARIABLE), os.environ["RANK"]


def test_a_rank_sees_its_callers_environment_and_nothing_the_caller_removed(monkeypatch):
    monkeypatch.setenv(VARIABLE, "set by the test")
    assert run_workers(_seen, 2) == [("set by the test", "0"), ("set by the test", "1")]
    monkeypatch.delenv(VARIABLE)
    assert run_workers(_seen, 2) == [(None, "0"), (None, "1")]
