"""A sweep grown by an axis: the runs it trained before the axis was added ran at the job's own value of that option,
so where that value is one of the axis's values they are that point's runs, and neither the grid nor a coordinate
descent trains them again. Earlier runs that fit no point of the current axes (an axis since dropped, or a job value
outside the axis) stay on disk and in the report's list of runs, apart from the ranking (``current_axes``).
"""

from __future__ import annotations

import json
from typing import Sequence

from torchtitan.study.plan import Axis, RunSpec, axes_for, axis_value, check_axes, lr_label, resolved_job
from torchtitan.study.run_folders import status_paths, write_status


def _job_value(config_file: str, train_args: Sequence[str], key: str):
    config = resolved_job(config_file, train_args)
    section, _, name = key.partition(".")
    return getattr(getattr(config, section, None), name, None)


def _matching(axis: Axis, value) -> str | None:
    """The axis value (as given) that is the job's own ``value`` of its option, or None."""
    for given in axis.values:
        if axis_value(given) == value or given.lower() == str(value).lower():
            return given
    return None


def adopt_earlier_runs(dump, specs: Sequence[RunSpec], axes: Sequence[Axis], config_file: str, train_args) -> list:
    """Give the runs of ``dump`` that lack an option of the current axes the job's own value of it (in their status's
    ``options``, which key the report's cells; their folders keep their names), when that value is one of the axis's;
    return ``specs`` without the runs those earlier runs already are."""
    axes = check_axes(axes, list(dict.fromkeys(s.optimizer for s in specs)), train_args)
    job_values: dict[str, object] = {}
    adopted = set()
    for path in status_paths(dump):
        status = json.loads(path.read_text())
        options = dict(status.get("options", {}))
        missing = [a for a in axes_for(status["optimizer"], axes) if a.key not in options]
        for axis in missing:
            if axis.key not in job_values:
                job_values[axis.key] = _job_value(config_file, train_args, axis.key)
            given = _matching(axis, job_values[axis.key])
            if given is None:
                break
            options[axis.key] = axis_value(given)
        else:
            if missing:
                write_status(path.parent, {**status, "options": options})
            point = tuple(sorted((k, v) for k, v in options.items()))
            adopted.add(
                (status["optimizer"], status.get("budget"), int(status["seed"]), lr_label(float(status["lr"])), point)
            )

    def covered(spec: RunSpec) -> bool:
        point = tuple(sorted((k, axis_value(v)) for k, v in spec.options))
        budget = spec.budget.tokens if spec.budget else None
        key = (spec.optimizer, budget, spec.seed, lr_label(spec.lr), point)
        return key in adopted and not (dump / "runs" / spec.name).exists()

    return [s for s in specs if not covered(s)]


def current_axes(specs: Sequence[RunSpec], axes: Sequence[Axis], train_args) -> dict[str, list[str]]:
    """Each optimizer's swept options other than the lr, as ``search.json`` records them for the report."""
    optimizers = list(dict.fromkeys(s.optimizer for s in specs))
    return {o: [a.key for a in axes_for(o, check_axes(axes, optimizers, train_args))] for o in optimizers}
