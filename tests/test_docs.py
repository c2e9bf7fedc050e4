"""Docs that cannot drift: what README.md and docs/*.md name exists, and every page is reachable from README.

The rules, one per kind of name:
- a dotted flag (``--section.key``) is a job option (``JobConfig``) or a 2024 torchtitan key we still read
  (``torchtitan.config.legacy.LEGACY_KEYS``); a tool's own flags have no dot (``--dump-folder``) and are the
  tool's business;
- a ``section.key`` in code whose section is a job-config section is such an option too, unless its last part is a
  file extension (``model.safetensors``, ``metrics.jsonl`` are files);
- ``python -m module`` names an importable module; a ``torchtitan.…`` name in code imports (module, then attributes);
- a path to a script, config or page (``.py``, ``.sh``, ``.slurm``, ``.toml``, ``.md``) exists, from the repository
  root or from ``torchtitan/`` (``optim/builder.py``); a bare script or config name (``optimizer.py`` in a row about
  its folder) exists somewhere in the repository; a ``folder/`` under one of the repository's own top-level folders
  exists. What a tool writes is not checked: paths under an upper-case placeholder (``DIR/gpu_check.md``) or
  ``outputs/``, and bare ``.md`` names (``sweep.md``);
- every relative link resolves, and every ``docs/*.md`` page is linked from README.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.config.legacy import LEGACY_KEYS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FILE_EXTENSIONS = {"json", "jsonl", "md", "model", "png", "py", "safetensors", "sh", "toml", "txt"}
CHECKED_EXTENSIONS = "py|sh|slurm|toml|md"
OWN_FOLDERS = ("assets/", "benchmarks/", "docs/", "scripts/", "tests/", "torchtitan/", "train_configs/")


def job_options() -> set[str]:
    return {f"{section}.{key}" for section, keys in JobConfig().to_dict().items() for key in keys} | set(LEGACY_KEYS)


def code_spans(text: str) -> list[str]:
    """The text of every fenced block and inline code span."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return blocks + inline


def repository_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [path for path in listed.splitlines() if (ROOT / path).exists()]


def named(check) -> list[str]:
    """``page: problem`` for every name ``check(page, text)`` reports, over README and every docs page."""
    return [f"{page.relative_to(ROOT)}: {problem}" for page in PAGES for problem in check(page, page.read_text())]


def unknown_flags(page: Path, text: str) -> list[str]:
    options = job_options()
    flags = re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*\.[a-z][a-z0-9_]*)", text)
    return sorted({f"--{flag} is not a job option" for flag in flags if flag not in options})


def unknown_dotted_options(page: Path, text: str) -> list[str]:
    options = job_options()
    sections = {option.split(".")[0] for option in options}
    found = set()
    for span in code_spans(text):
        for section, key in re.findall(r"(?<![\w./-])([a-z][a-z0-9_]*)\.([a-z][a-z0-9_]*)(?![\w.(/-])", span):
            if section in sections and key not in FILE_EXTENSIONS and f"{section}.{key}" not in options:
                found.add(f"{section}.{key} is not a job option")
    return sorted(found)


def named_modules(text: str) -> set[str]:
    return set(re.findall(r"\bpython3? -m ([A-Za-z_][\w.]*)", text))


def named_python_names(text: str) -> set[str]:
    return {name for span in code_spans(text) for name in re.findall(r"(?<![\w./-])(torchtitan(?:\.\w+)+)", span)}


def missing_modules(page: Path, text: str) -> list[str]:
    failing = _fail_in_fresh_interpreter("module", named_modules(text))
    return sorted(f"python -m {module}: no such module" for module in failing)


def unknown_python_names(page: Path, text: str) -> list[str]:
    return sorted(f"{name} does not import" for name in _fail_in_fresh_interpreter("name", named_python_names(text)))


# Run in a fresh interpreter: importing what the docs name (the tools, torch.distributed.run, ...) into the test
# process would leave modules behind that change later tests (inductor refuses to compile after some of them).
_CHECK_IMPORTS = """
import importlib, importlib.util, json, sys

def importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent that is missing, or a module that moved
        return False

def resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                target = getattr(target, attribute)
        except AttributeError:
            return False
        return True
    return False

kind, names = json.loads(sys.stdin.read())
check = importable if kind == "module" else resolves
print(json.dumps([name for name in names if not check(name)]))
"""


# {kind: {name: whether it imports}}; the first question of a kind asks it of every page's names at once, so the
# whole check starts one interpreter per kind rather than one per page.
_CHECKED: dict[str, dict[str, bool]] = {"module": {}, "name": {}}
_NAMED_ON_EVERY_PAGE = {"module": named_modules, "name": named_python_names}


def _fail_in_fresh_interpreter(kind: str, names: set[str]) -> list[str]:
    checked = _CHECKED[kind]
    if names - checked.keys():
        every = set().union(names, *(_NAMED_ON_EVERY_PAGE[kind](page.read_text()) for page in PAGES))
        asked = sorted(every - checked.keys())
        done = subprocess.run(
            [sys.executable, "-c", _CHECK_IMPORTS],
            input=json.dumps([kind, asked]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        failing = set(json.loads(done.stdout.strip().splitlines()[-1]))
        checked.update({name: name not in failing for name in asked})
    return sorted(name for name in names if not checked[name])


def missing_paths(page: Path, text: str) -> list[str]:
    files = repository_files()
    basenames = {Path(path).name for path in files}
    folders = {str(parent) + "/" for path in files for parent in Path(path).parents if str(parent) != "."}
    linked = set(links(text))  # a link is checked by the link rule
    found = set()
    for path in re.findall(rf"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:{CHECKED_EXTENSIONS}))(?![\w/-])", text):
        if path in linked or re.match(r"([A-Z_]+|outputs)/", path) or ("/" not in path and path.endswith(".md")):
            continue
        if "/" in path:
            exists = (ROOT / path).is_file() or (ROOT / "torchtitan" / path).is_file()
        else:
            exists = path in basenames
        if not exists:
            found.add(f"{path} does not exist")
    for folder in re.findall(r"(?<![\w./-])((?:[\w-]+/)+)(?![\w.-])", text):
        if folder.startswith(OWN_FOLDERS) and folder not in folders:
            found.add(f"{folder} does not exist")
    return sorted(found)


def links(text: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", target)]


def broken_links(page: Path, text: str) -> list[str]:
    return sorted(
        {
            f"link {target} does not resolve"
            for target in links(text)
            if target.split("#")[0] and not (page.parent / target.split("#")[0]).exists()
        }
    )


@pytest.mark.parametrize(
    "check", [unknown_flags, unknown_dotted_options, missing_modules, unknown_python_names, missing_paths]
)
def test_what_the_docs_name_exists(check):
    assert named(check) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(README.read_text())}
    assert [str(page.relative_to(ROOT)) for page in PAGES[1:] if page.resolve() not in linked] == []


def test_every_relative_link_resolves():
    assert named(broken_links) == []


def test_the_rules_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    text = (
        "Run `python -m torchtitan.no_such_tool` with `--training.no_such_key 1` and `--dump-folder x`;\n"
        "set `checkpoint.no_such_option`, read `model.safetensors`, import `torchtitan.optim.no_such_name`;\n"
        "see `scripts/no_such_script.sh`, `no_such_module.py`, `torchtitan/no_such_folder/` and [a](gone.md).\n"
    )
    page.write_text(text)
    assert unknown_flags(page, text) == ["--training.no_such_key is not a job option"]
    assert unknown_dotted_options(page, text) == ["checkpoint.no_such_option is not a job option"]
    assert missing_modules(page, text) == ["python -m torchtitan.no_such_tool: no such module"]
    assert unknown_python_names(page, text) == [
        "torchtitan.no_such_tool does not import",
        "torchtitan.optim.no_such_name does not import",
    ]
    assert missing_paths(page, text) == [
        "no_such_module.py does not exist",
        "scripts/no_such_script.sh does not exist",
        "torchtitan/no_such_folder/ does not exist",
    ]
    assert broken_links(page, text) == ["link gone.md does not resolve"]
    real = (
        "`python -m torchtitan.tools.sweep --dump-folder D --training.steps 3`, `torchtitan/optim/muon/`, `train.py`,"
        " `optim/builder.py`, `DIR/gpu_check.md`, `outputs/sweep/sweep.md`, `sweep.md`"
    )
    assert [check(page, real) for check in (unknown_flags, missing_modules, missing_paths)] == [[], [], []]


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 250, "README.md: keep it to 250 lines; put detail in a docs/ page"
