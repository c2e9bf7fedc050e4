"""A study while it trains: the page written after every run, saying what is still pending, and confirmation seeds
that no earlier selection run of the folder used. The sweep's runs are tests/sweep_fake_trainer.py's."""

from __future__ import annotations

import html
import json

from tests.helpers import fake_sweep, one_error_line
from torchtitan.study import report as study_report

GRID = ("--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3,1e-2", "--seeds", "0")


def test_a_confirmed_study_has_a_page_after_every_run_saying_what_is_pending(tmp_path, monkeypatch, capsys):
    # 6 selection runs, then 2 x 2 confirmation runs: the page is rewritten after each of the 10, never fails (the
    # verdict's figures once read the confirmation runs before any existed), and says what is still to come.
    monkeypatch.setattr(study_report, "INTERIM_REPORT_SECONDS", 0.0)
    dump = tmp_path / "sweep"
    pages = []
    original = study_report.InterimReport.__call__

    def keep_page(self):
        original(self)
        pages.append(html.unescape((dump / study_report.PAGE_NAME).read_text()))

    monkeypatch.setattr(study_report.InterimReport, "__call__", keep_page)
    assert fake_sweep(dump, *GRID, "--confirm-seeds", "1,2") == 0
    out = capsys.readouterr().out
    assert "no report yet" not in out and out.count("report so far") == 10
    assert len(pages) == 10
    assert "Study in progress: 1 of 6 selection runs have ended; pending: " in pages[0]
    assert "then each optimizer's best settings train on confirmation seeds 1, 2." in pages[0]
    assert "6 of 6 selection runs have ended; then each optimizer" in pages[5]
    assert "not confirmed yet" in pages[5]
    assert "Study in progress: 1 of 4 confirmation runs have ended; pending: " in pages[6]
    assert "4 of 4 confirmation runs have ended." in pages[9]
    final = (dump / study_report.PAGE_NAME).read_text()
    assert "Study in progress" not in final and json.loads((dump / "sweep.json").read_text())["in_progress"] is None


def test_confirmation_seeds_are_never_seeds_an_earlier_selection_run_trained_on(tmp_path, capsys):
    # Call 1 chose between two lrs on seeds 0, 1; call 2 would "confirm" lr 1e-3 on those very seeds.
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, "--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3", "--seeds", "0,1") == 0
    before, search = run_names(dump), (dump / "search.json").read_text()
    capsys.readouterr()
    assert (
        fake_sweep(dump, "--optimizers", "AdamW,Muon", "--lrs", "1e-3", "--seeds", "2", "--confirm-seeds", "0,1") == 2
    )
    error = one_error_line(capsys)
    assert "--confirm-seeds 0, 1: earlier selection runs in this folder trained on them (AdamW_lr1e-3_seed0" in error
    assert "confirm on seeds no run here used, like '3,4'" in error
    assert run_names(dump) == before and (dump / "search.json").read_text() == search  # nothing trained or recorded
    # Fresh seeds confirm; a later call may add an optimizer, confirmed on the same fresh seeds...
    assert (
        fake_sweep(dump, "--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3", "--seeds", "0,1", "--confirm-seeds", "2")
        == 0
    )
    assert fake_sweep(dump, "--optimizers", "NorMuon", "--lrs", "1e-3", "--seeds", "0,1") == 0
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["NorMuon"]["seeds"] == [2] and report["best"]["NorMuon"]["selection"]["seeds"] == [0, 1]
    # ...but never on a seed its own selection used, nor by dropping the confirmation seeds already run.
    capsys.readouterr()
    args = ("--optimizers", "NorMuon", "--lrs", "1e-3", "--seeds", "3")
    assert fake_sweep(dump, *args, "--confirm-seeds", "0") == 2
    assert "--confirm-seeds 0: earlier selection runs in this folder trained on it" in one_error_line(capsys)
    assert fake_sweep(dump, *args, "--confirm-seeds", "4") == 2
    assert "--confirm-seeds leaves out 2, which this study's confirmation runs used" in one_error_line(capsys)
    assert not any(name.endswith(("seed3", "seed4")) for name in run_names(dump))


def run_names(dump) -> list[str]:
    return sorted(p.name for p in (dump / "runs").iterdir())


# ----------------------------------------------------------------------------------------------------------------
# Fresh validation windows for confirmation


def test_confirmation_runs_score_validation_windows_that_selection_never_scored(tmp_path):
    from tests.data.test_validation import SEQ_LEN, TOKENIZER, random_tokens_folder
    from torchtitan.datasets import build_tokenizer

    # 40 windows, every 4th held out: 10 validation windows; selection scores 0-2, confirmation seed 2 scores 3-5
    # and seed 3 scores 6-8.
    folder = random_tokens_folder(tmp_path / "tokens", build_tokenizer(str(TOKENIZER)), 40)
    train = ["--model.tokenizer_path", str(TOKENIZER), "--training.dataset", "tokens", "--training.dataset_path"]
    train += [folder, "--training.seq_len", str(SEQ_LEN), "--validation.enable", "--validation.held_out_every", "4"]
    train += ["--validation.windows", "3"]
    dump = tmp_path / "sweep"
    grid = ("--optimizers", "AdamW,Muon", "--lrs", "1e-3", "--seeds", "0,1", "--confirm-seeds", "2,3")
    assert fake_sweep(dump, *grid, "--", *train, validation=True) == 0
    commands = {p.name: (p / "command.sh").read_text() for p in (dump / "runs").iterdir()}
    for name, command in commands.items():
        first = {"seed2": "3", "seed3": "6"}.get(name.rsplit("_", 1)[-1])
        assert ("--validation.first_window" in command) == (first is not None), name
        assert first is None or f"--validation.first_window {first}" in command
    page = html.unescape((dump / study_report.PAGE_NAME).read_text())
    assert "Each confirmation seed scored validation windows of its own, which no selection run scored" in page
    assert "(seed 2 3 to 5, seed 3 6 to 8; selection: 0 to 2)" in page
    # With room for no second range, confirmation scores the selection's windows and the page says why.
    dump = tmp_path / "small"
    assert fake_sweep(dump, *grid, "--", *train[:-1], "6", validation=True) == 0
    assert not any("first_window" in (p / "command.sh").read_text() for p in (dump / "runs").iterdir())
    page = html.unescape((dump / study_report.PAGE_NAME).read_text())
    assert "scored the selection's validation windows: the held-out data holds 10 validation windows, fewer" in page
