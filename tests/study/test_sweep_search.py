"""Study runs: coordinate descent over the swept settings, runs packed K at a time onto the machine's GPUs or CPU,
and every run traceable from the report to its folder, command and config.

The descent itself is a pure function tested on made-up scores; the sweep's part (resume, retries, the report's
path) uses tests/sweep_fake_trainer.py, whose loss is lowest at lr 1e-3 and at weight decay 0.1 (0.3 for Muon).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import FAKE, attempts, fake_sweep, one_error_line, status_of, sweep_env
from torchtitan.errors import UserError
from torchtitan.study.plan import Axis, RunSpec
from torchtitan.study.search import (
    BLOCKED,
    LR,
    Coordinate,
    Space,
    descend,
    parse_starts,
    search_spaces,
)

# ----------------------------------------------------------------------------------------------------------------
# The descent on made-up scores


def grid_space(sizes, start) -> Space:
    return Space(tuple(Coordinate(f"c{n}", tuple(map(str, range(size)))) for n, size in enumerate(sizes)), start)


def run_to_the_end(space: Space, loss) -> tuple:
    """Drive the descent as the sweep does: score what it asks for, replay, until it needs nothing; the points it
    asked for, in order, and its last state."""
    known: dict = {}
    asked = []
    while True:
        descent = descend(space, lambda p: known.get(p))
        if not descent.needed:
            return asked, descent
        for point in descent.needed:
            assert point not in known  # nothing is ever asked for twice
            asked.append(point)
            known[point] = loss(point)


def test_the_descent_walks_one_setting_at_a_time_to_the_optimum_of_a_separable_loss():
    space = grid_space((7, 5), start=(0, 4))

    def loss(p):
        return (p[0] - 5) ** 2 + 2.0 * (p[1] - 1) ** 2

    asked, descent = run_to_the_end(space, loss)
    assert descent.state == "converged" and descent.current == (5, 1) and descent.score == 0.0
    # Along c0 from 0: right until 6 is worse than 5; along c1 from 4: down to 1 (0 is worse); c0 checked again.
    assert asked[0] == (0, 4)
    assert asked[1:7] == [(1, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 4)]
    assert set(asked[7:]) == {(5, 3), (5, 2), (5, 1), (5, 0), (4, 1), (6, 1)}
    assert len(asked) < 7 * 5
    moves = [s for s in descent.path[1:] if s["moved"]]
    assert [(s["coordinate"], s["to"]) for s in moves] == [
        (0, (1, 4)),
        (0, (2, 4)),
        (0, (3, 4)),
        (0, (4, 4)),
        (0, (5, 4)),
        (1, (5, 3)),
        (1, (5, 2)),
        (1, (5, 1)),
    ]
    # Replaying over the same scores gives the same path: the report draws it from the run folders alone.
    known = {p: loss(p) for p in asked}
    assert descend(space, known.get).path == descent.path


def test_the_descent_ends_where_no_single_step_improves_even_when_settings_interact():
    # A valley along the diagonal: one pass along each setting is not enough, the descent keeps cycling.
    space = grid_space((9, 9), start=(0, 0))

    def loss(p):
        return (p[0] - p[1]) ** 2 * 0.5 + (p[0] + p[1] - 12) ** 2 * 0.1

    asked, descent = run_to_the_end(space, loss)
    end = descent.current
    for n in range(2):
        for d in (-1, 1):
            neighbour = tuple(i + d if k == n else i for k, i in enumerate(end))
            if 0 <= neighbour[n] < 9:
                assert loss(neighbour) >= loss(end)
    assert loss(end) < loss((0, 0)) and len([s for s in descent.path[1:] if s["moved"]]) > 2


def test_diverged_points_are_never_chosen_and_a_failed_point_blocks():
    space = grid_space((5,), start=(2,))
    scores = {(0,): 1.0, (1,): 2.0, (2,): 3.0, (3,): math.inf, (4,): 0.5}
    descent = descend(space, scores.get)
    assert descent.state == "converged" and descent.current == (0,)  # (4,) is never reached past the divergence
    # A diverged start moves to any finite neighbour.
    assert descend(grid_space((3,), (1,)), {(0,): math.inf, (1,): math.inf, (2,): 9.0}.get).current == (2,)
    # A failed run: the descent stops, with nothing it can ask for.
    blocked = descend(space, {(1,): BLOCKED, (2,): 3.0, (3,): 4.0}.get)
    assert blocked.state == "blocked" and blocked.needed == [] and blocked.current == (2,)
    # Unknown neighbours are asked for together, so that they can train at once.
    assert descend(space, {(2,): 3.0}.get).needed == [(1,), (3,)]


def test_each_optimizer_gets_its_grid_and_start_from_the_command_line():
    axes = [Axis("optimizer.weight_decay", ("0.3", "0.0", "0.1")), Axis("optimizer.momentum", ("0.9", "0.95"), "Muon")]
    spaces = search_spaces(["AdamW", "Muon"], [3e-3, 1e-3, 3e-4, 1e-2], axes, [])
    adamw, muon = spaces["AdamW"], spaces["Muon"]
    assert [c.key for c in adamw.coordinates] == [LR, "optimizer.weight_decay"]
    assert [c.key for c in muon.coordinates] == [LR, "optimizer.momentum", "optimizer.weight_decay"]
    assert adamw.coordinates[0].values == ("3e-4", "1e-3", "3e-3", "1e-2")  # numbers in ascending order
    assert adamw.coordinates[1].values == ("0.0", "0.1", "0.3")
    # The middle of each setting (the lower middle of an even count).
    assert adamw.settings(adamw.start) == {LR: 1e-3, "optimizer.weight_decay": 0.1}
    starts = parse_starts(["optimizer.lr=3e-3", "muon:optimizer.lr=1e-2", "Muon:optimizer.momentum=0.95"])
    spaces = search_spaces(["AdamW", "Muon"], [3e-3, 1e-3, 3e-4, 1e-2], axes, starts)
    assert spaces["AdamW"].settings(spaces["AdamW"].start)[LR] == 3e-3
    assert spaces["Muon"].settings(spaces["Muon"].start) == {
        LR: 1e-2,
        "optimizer.momentum": 0.95,
        "optimizer.weight_decay": 0.1,
    }
    # A point is a run spec's lr and options, as the grid names them.
    point = spaces["Muon"].start
    assert RunSpec("Muon", spaces["Muon"].lr(point), 0, None, spaces["Muon"].options(point)).name == (
        "Muon_lr1e-2_seed0_optimizer.momentum0.95_optimizer.weight_decay0.1"
    )


@pytest.mark.parametrize(
    "starts, message",
    [
        (["optimizer.lr=5e-3"], "--start optimizer.lr=5e-3 is not one of its values (3e-4, 1e-3)"),
        (["optimizer.beta2=0.95"], "--start optimizer.beta2 is not a swept setting of AdamW's runs"),
        (["Muon:optimizer.lr=1e-3"], "--start Muon:optimizer.lr: Muon is not in --optimizers"),
        (["optimizer.lr"], "--start 'optimizer.lr' is not a start point"),
        (["optimizer.lr=1e-3,3e-4"], "is not a start point"),
    ],
)
def test_bad_start_points_are_one_line(starts, message):
    with pytest.raises(UserError, match=re.escape(message)):
        search_spaces(["AdamW"], [1e-3, 3e-4], [], parse_starts(starts))


# ----------------------------------------------------------------------------------------------------------------
# The sweep with --search coordinate


DESCENT = [
    "--optimizers",
    "AdamW,Muon",
    "--lrs",
    "1e-4,3e-4,1e-3,3e-3,1e-2",
    "--axis",
    "optimizer.weight_decay=0.0,0.1,0.2,0.3,0.5",
    "--search",
    "coordinate",
]


def test_coordinate_descent_finds_the_best_with_fewer_runs_resumes_and_shows_its_path(tmp_path, capsys):
    dump = tmp_path / "descent"
    # A run on AdamW's path fails: its descent stops there, Muon's goes on; the sweep says so and exits 1.
    failing = "AdamW_lr1e-3_seed0_optimizer.weight_decay0.1"
    assert fake_sweep(dump, *DESCENT, "--parallel", "2", outcomes={failing: "exit1"}) == 1
    assert "error: 1 of 2 descents stopped at a run that failed" in capsys.readouterr().err
    md = (dump / "sweep.md").read_text()
    assert "Coordinate descent, AdamW: stopped at a run that failed (run the sweep again to retry it)" in md
    assert "Coordinate descent, Muon: converged at lr 1e-3, optimizer.weight_decay 0.3" in md
    runs = dump / "runs"
    before = {p.name for p in runs.iterdir()}

    # Again: the failed run trains again, no finished run does, and AdamW's descent goes on to its best.
    assert fake_sweep(dump, *DESCENT, "--parallel", "2") == 0
    assert attempts(runs / failing) == 2
    assert all(attempts(p) == 1 for p in runs.iterdir() if p.name != failing)
    assert before < {p.name for p in runs.iterdir()}
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3, "optimizer.weight_decay": 0.1}
    assert report["best"]["Muon"]["settings"] == {"lr": 1e-3, "optimizer.weight_decay": 0.3}
    trained = len(list(runs.iterdir()))
    assert trained < 2 * 25
    descents = {d["optimizer"]: d for d in report["descents"]}
    assert {d["state"] for d in descents.values()} == {"converged"}
    assert sum(d["points_scored"] for d in descents.values()) == trained
    # AdamW starts in the middle (lr 1e-3, weight decay 0.2): the lr stays, the weight decay moves to 0.1.
    path = descents["AdamW"]["path"]
    assert path[0] == {
        "step": "start",
        "settings": {"lr": 1e-3, "optimizer.weight_decay": 0.2},
        "loss": path[0]["loss"],
    }
    assert [(s["setting"], s["moved"], s["to"]) for s in path[1:3]] == [
        ("lr", False, None),
        ("optimizer.weight_decay", True, 0.1),
    ]
    md = (dump / "sweep.md").read_text()
    assert "| 2 | optimizer.weight_decay | 0.2 | 0.1: " in md and "| moved to 0.1 |" in md
    assert "<h2>Coordinate descent</h2>" in (dump / "study.html").read_text()

    # The report is rebuilt from the run folders alone, path included.
    (dump / "sweep.json").unlink()
    assert fake_sweep(dump, "--report-only") == 0
    assert json.loads((dump / "sweep.json").read_text())["descents"] == report["descents"]


def test_a_descent_over_seeds_and_budgets_and_its_bad_input(tmp_path, capsys):
    dump = tmp_path / "descent"
    args = ["--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", "--seeds", "0,1", "--budgets", "2048,4096"]
    assert fake_sweep(dump, *args, "--search", "coordinate", "--start", "optimizer.lr=1e-4") == 0
    report = json.loads((dump / "sweep.json").read_text())
    assert [(d["budget"], d["best"]) for d in report["descents"]] == [(2048, {"lr": 1e-3}), (4096, {"lr": 1e-3})]
    # Each point is scored over every seed: from 1e-4 up to 1e-3, then 1e-2 is worse; 3 points x 2 seeds x 2 budgets.
    assert len(list((dump / "runs").iterdir())) == 12
    capsys.readouterr()

    for extra, message in (
        (["--search", "coordinate"], "--search coordinate has nothing to descend"),
        (["--start", "optimizer.lr=1e-3"], "--start sets where a coordinate descent starts"),
        (["--search", "coordinate", "--start", "optimizer.lr=2e-3"], "is not one of its values (1e-3)"),
    ):
        assert fake_sweep(tmp_path / "bad", "--optimizers", "AdamW", "--lrs", "1e-3", *extra) == 2
        assert message in one_error_line(capsys)
        assert not (tmp_path / "bad" / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# K runs at once


def test_slots_give_each_run_gpus_of_its_own():
    from torchtitan.study.scheduling import Slot, plan_slots, visible_gpus

    assert plan_slots(4, 2, [str(i) for i in range(8)]) == [
        Slot(0, ("0", "1")),
        Slot(1, ("2", "3")),
        Slot(2, ("4", "5")),
        Slot(3, ("6", "7")),
    ]
    assert plan_slots(3, 2, []) == [Slot(0), Slot(1), Slot(2)]  # no GPUs: K processes
    with pytest.raises(UserError, match=re.escape("--parallel 3 runs of 2 GPU(s) each need 6 GPUs, but 4 are")):
        plan_slots(3, 2, ["0", "1", "2", "3"])
    with pytest.raises(UserError, match="--parallel must be at least 1"):
        plan_slots(0, 1, [])
    # The ids a run is given are the ones this process was given.
    assert Slot(1, ("5", "7")).environment() == {"CUDA_VISIBLE_DEVICES": "5,7"}
    import torch

    if torch.cuda.device_count() == 0:
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == [] and visible_gpus({}) == []


def fake_gpus(monkeypatch, gpus: list[str]) -> None:
    import torchtitan.study.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "visible_gpus", lambda environ: list(gpus))


def runs_at_once(records: list[dict]) -> int:
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records], key=lambda e: (e[0], e[1]))
    return max(itertools.accumulate(delta for _, delta in events))


def test_parallel_runs_on_gpus_of_their_own_and_the_results_do_not_depend_on_k(tmp_path, monkeypatch, capsys):
    from torchtitan.tools.sweep import main

    # A machine with 4 GPUs (as this process sees them), 2 runs at once: each run gets 2 GPUs, never another's.
    fake_gpus(monkeypatch, ["4", "5", "6", "7"])
    grid = ["--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3,1e-2"]
    argv = ["--launcher", FAKE, "--last-k", "3", *grid, "--parallel", "2"]
    monkeypatch.setenv("FAKE_RECORD", "1")
    monkeypatch.setenv("FAKE_SECONDS", "0.5")
    assert main(["--dump-folder", str(tmp_path / "k2"), *argv]) == 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "k2" / "runs").glob("*/fake_run.json")]
    assert len(records) == 6 and {r["NGPU"] for r in records} == {"2"}
    assert {r["CUDA_VISIBLE_DEVICES"] for r in records} == {"4,5", "6,7"}
    assert runs_at_once(records) == 2
    for a, b in itertools.combinations(records, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            assert a["CUDA_VISIBLE_DEVICES"] != b["CUDA_VISIBLE_DEVICES"]
    assert "training on GPU 6,7" in capsys.readouterr().out
    status = status_of(tmp_path / "k2" / "runs" / "AdamW_lr1e-3_seed0")
    assert status["environment"]["NGPU"] == "2" and status["environment"]["CUDA_VISIBLE_DEVICES"] in ("4,5", "6,7")

    # More runs at once than the GPUs allow: one line, nothing run.
    assert main(["--dump-folder", str(tmp_path / "k3"), *argv[:-1], "3", "--nproc", "2"]) == 2
    assert "--parallel 3 runs of 2 GPU(s) each need 6 GPUs, but 4 are present (4,5,6,7)" in one_error_line(capsys)
    assert not (tmp_path / "k3").exists()

    # The same sweep one run at a time: the same report, number for number, but for the time each run took.
    assert main(["--dump-folder", str(tmp_path / "k1"), *argv[:-1], "1"]) == 0
    k1, k2 = (json.loads((tmp_path / k / "sweep.json").read_text()) for k in ("k1", "k2"))
    timing = {"seconds", "mean_tps", "min_tps", "max_tps"}

    def numbers(report):
        return [{k: v for k, v in r.items() if k not in timing} for r in report["runs"]], report["best"]

    assert numbers(k1)[0] == numbers(k2)[0]
    assert k1["best"].keys() == k2["best"].keys()
    assert runs_at_once([json.loads(p.read_text()) for p in (tmp_path / "k1" / "runs").glob("*/fake_run.json")]) == 1


def test_each_run_keeps_its_command_which_runs_again_and_the_report_links_it(tmp_path):
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3,1e-2", "--seeds", "0,1", FAKE_RECORD="1") == 0
    run = dump / "runs" / "AdamW_lr1e-2_seed1"
    script = (run / "command.sh").read_text()
    assert "NGPU=1 CONFIG_FILE=" in script and status_of(run)["command"] in script
    # command.sh repeats the run in its folder (one more logging folder), with the sweep's environment.
    (run / "fake_run.json").unlink()
    proc = subprocess.run(
        ["bash", str(run / "command.sh")], env=sweep_env(FAKE_RECORD="1"), capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "fake_run.json").read_text())["NGPU"] == "1"
    assert len({p.parent for p in run.rglob("events.out.tfevents*")}) == 2

    # Every link of the page and of sweep.md resolves to a file or folder of the sweep, and each grid cell links
    # the folders of its seeds.
    page = (dump / "study.html").read_text()
    links = re.findall(r'href="([^"]+)"', page)
    md_links = re.findall(r"\]\(([^)]+)\)", (dump / "sweep.md").read_text())
    assert links and set(md_links) <= set(links)
    assert all((dump / link).exists() for link in links), [link for link in links if not (dump / link).exists()]
    for lr in ("1e-3", "1e-2"):
        cell = f'<a href="runs/AdamW_lr{lr}_seed0/">seed 0</a> <a href="runs/AdamW_lr{lr}_seed1/">seed 1</a>'
        assert cell in page
    assert 'href="runs/AdamW_lr1e-2_seed1/command.sh"' in page
    assert all(Path(dump / link).name != "job_config.toml" for link in links)  # the fake trainer writes none


def test_the_report_is_rewritten_while_the_sweep_trains(tmp_path, monkeypatch, capsys):
    import torchtitan.study.report as sweep_module

    # Every run's end rewrites the report (a real sweep: at most every INTERIM_REPORT_SECONDS); the third run stops
    # the sweep with a mistake before its final report, and the page shows the two runs that ended.
    monkeypatch.setattr(sweep_module, "INTERIM_REPORT_SECONDS", 0.0)
    outcomes = {"AdamW_lr1e-2_seed0": "exit2"}
    assert fake_sweep(tmp_path / "sweep", "--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", outcomes=outcomes) == 2
    assert capsys.readouterr().out.count("report so far: ") == 2
    report = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["AdamW_lr1e-4_seed0", "AdamW_lr1e-3_seed0"]
    assert (tmp_path / "sweep" / "study.html").is_file()
