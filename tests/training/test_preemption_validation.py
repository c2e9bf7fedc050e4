"""A stop signal at a step whose validation is due: the run saves and stops at once (a validation would spend the
warning), and the resumed run validates that step before it trains on."""

from __future__ import annotations

import signal

from tests.helpers import train
from tests.training.test_preemption import ARGS, SIGNAL_AFTER, logged, signalled_run, stopped_at
from torchtitan.errors import PREEMPTED_EXIT_CODE

VALIDATION = ("--validation.enable", "--validation.freq", str(SIGNAL_AFTER), "--validation.steps", "1")
SHORT = ("--training.steps", "4")  # the fewest that validate before and after the stop


def test_a_stop_at_a_due_validation_saves_first_and_the_resumed_run_validates_that_step(tmp_path):
    dump = str(tmp_path)
    code, output = signalled_run(dump, signal.SIGTERM, extra=(*VALIDATION, *SHORT))
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert stopped_at(output) == SIGNAL_AFTER
    assert logged(dump, "validation/loss") == {}  # stopped before the validation due at that step
    train(dump, *ARGS, *VALIDATION, *SHORT, cpu=True)
    assert sorted(logged(dump, "validation/loss")) == [2, 4]  # step 2 validated by the resumed run
