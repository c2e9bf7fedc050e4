"""Which W&B run a resumed training run logs to: the kept one, continued, when nothing it logged is abandoned;
otherwise (resumed from an older checkpoint than its last logged step, or offline) a new run linked to it."""

from __future__ import annotations

import json

from torchtitan.telemetry.metrics import read_wandb_record, wandb_continuation


def test_a_run_resumed_where_its_wandb_run_stopped_continues_it():
    assert wandb_continuation({"id": "abc", "step": 400}, 400, offline=False) == ("abc", None)
    assert wandb_continuation({"id": "abc", "step": None}, 400, offline=False) == ("abc", None)  # older id files


def test_a_run_resumed_before_its_last_logged_step_is_a_new_run_linked_to_the_old():
    # W&B drops steps logged again: continuing would keep the abandoned attempt's steps 301..400.
    assert wandb_continuation({"id": "abc", "step": 400}, 300, offline=False) == (None, {"run_id": "abc", "step": 300})


def test_an_offline_resumed_run_is_always_a_new_run_and_a_fresh_run_never_continues():
    assert wandb_continuation({"id": "abc", "step": 400}, 400, offline=True) == (None, {"run_id": "abc", "step": 400})
    assert wandb_continuation({"id": "abc", "step": 400}, 0, offline=False) == (None, None)
    assert wandb_continuation(None, 400, offline=False) == (None, None)


def test_the_kept_record_is_read_in_both_formats(tmp_path):
    path = tmp_path / ".AdamW.wandb-run-id"
    path.write_text("abc\n")
    assert read_wandb_record(str(path)) == {"id": "abc", "step": None}
    path.write_text(json.dumps({"id": "abc", "step": 12}))
    assert read_wandb_record(str(path)) == {"id": "abc", "step": 12}
    assert read_wandb_record(str(tmp_path / "none")) is None and read_wandb_record(None) is None
