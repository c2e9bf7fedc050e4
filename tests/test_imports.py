"""The package's import graph: no cycle anywhere in torchtitan/, every module imports, moved names say where to.

The graph is read from the source with ``ast``, every ``import`` statement counted wherever it sits (module level,
inside a function, under ``try``), so a cycle that only shows when some function first runs is caught too. An edge
goes from a module to each module an import statement reads: ``import a.b`` reads ``a.b``; ``from p import n`` reads
``p`` (its namespace is looked up, even while ``p`` is still being imported) and ``p.n`` when that is a module.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import torchtitan.optim as optim
from torchtitan.moved import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[1]


def module_files(package_root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` under ``package_root`` (a package folder)."""
    modules = {}
    for path in sorted(package_root.rglob("*.py")):
        parts = path.relative_to(package_root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules of ``modules`` that one import statement in ``module`` reads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's own package, one level up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    return [source] + [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}``, function-level imports included."""
    modules = module_files(package_root)
    top = package_root.name
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py", modules):
                if target == top or target.startswith(top + "."):
                    edges.add(target)
    return graph


def unknown_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets - set(graph))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` through each strongly connected group of modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_cycle_through(graph, set(group), group[0]) for group in groups)


def _cycle_through(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    paths = {target: [start, target] for target in sorted(graph[start] & group)}
    frontier = list(paths)
    while start not in paths:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    next_frontier.append(target)
        frontier = next_frontier
    return paths[start]


def test_no_import_cycle_in_torchtitan():
    found = cycles(import_graph(ROOT / "torchtitan"))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_every_torchtitan_import_names_a_module_that_exists():
    assert unknown_imports(import_graph(ROOT / "torchtitan")) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_walk_finds_a_cycle_closed_by_a_function_level_import(tmp_path):
    # The shape storage <-> torchao adapter had: one side imports the other only inside a function.
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/storage.py": "def zeros():\n    from pkg.adapter import quiet_import\n",
            "pkg/adapter.py": "from pkg.storage import zeros\n",
            "pkg/alone.py": "import pkg.storage\n",
        },
    )
    assert cycles(import_graph(package)) == [["pkg.adapter", "pkg.storage", "pkg.adapter"]]


def test_the_walk_finds_a_cycle_through_a_package_init(tmp_path):
    # The shape checkpoint/__init__ <-> checkpoint/manager had: the manager reads a sibling from the package.
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.manager import Manager\n",
            "pkg/manager.py": "from pkg import hf\nclass Manager: ...\n",
            "pkg/hf.py": "from . import codec\n",
            "pkg/codec.py": "",
        },
    )
    graph = import_graph(package)
    assert graph["pkg.hf"] == {"pkg", "pkg.codec"}  # relative imports resolve like absolute ones
    assert cycles(graph) == [["pkg", "pkg.manager", "pkg"]]


def test_the_walk_reports_an_import_of_a_module_that_does_not_exist(tmp_path):
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def f():\n    import pkg.gone\n"})
    assert unknown_imports(import_graph(package)) == ["pkg.a imports pkg.gone"]


def test_every_torchtitan_module_imports():
    failures = []
    for module in module_files(ROOT / "torchtitan"):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - every failure is listed, not just the first
            failures.append(f"{module}: {type(e).__name__}: {e}")
    assert failures == []


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_a_moved_module_fails_with_one_line_naming_its_new_home(old, new):
    importlib.import_module(new)
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module(old)
    assert str(raised.value) == f"{old} moved to {new}: import it from there"
    package, name = old.rsplit(".", 1)
    with pytest.raises(ImportError) as raised:
        exec(f"from {package} import {name}", {})
    assert str(raised.value) == f"{old} moved to {new}: import it from there"


def test_a_name_of_a_module_that_became_a_package_says_where_it_lives():
    with pytest.raises(ImportError, match=r"^torchtitan.optim.muon is a package now: import split_hidden_matrices"):
        exec("from torchtitan.optim.muon import split_hidden_matrices", {})
    with pytest.raises(ImportError, match=r"^torchtitan.optim.adam_mini is a package now: import FUSED from"):
        exec("from torchtitan.optim.adam_mini import FUSED", {})
    assert not hasattr(importlib.import_module("torchtitan.optim.adam_mini"), "no_such_name")


def test_the_public_names_resolve_to_their_homes():
    from torchtitan.optim.adam_mini import AdamMini, adam_mini_update, optimizer
    from torchtitan.optim.muon import Muon
    from torchtitan.optim.muon import optimizer as muon_optimizer

    assert (AdamMini, adam_mini_update, Muon) == (optimizer.AdamMini, optimizer.adam_mini_update, muon_optimizer.Muon)
    for name in optim.__all__:
        assert getattr(optim, name).__module__.startswith("torchtitan.optim.")
    with pytest.raises(AttributeError, match="has no attribute 'Adam_mini'"):
        optim.Adam_mini  # noqa: B018


def test_the_torch_free_modules_import_without_torch():
    code = (
        "import sys\n"
        "import torchtitan.optim.settings, torchtitan.optim.adam_mini.partition\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False"]


def test_no_lower_layer_imports_the_study_or_the_tools():
    # The study (torchtitan/study/) sits on the trainer's packages and the command-line tools on top of both: an
    # arrow from the trainer up to either would make the trainer depend on the study's figures and statistics.
    upper = ("torchtitan.study", "torchtitan.tools")
    graph = import_graph(ROOT / "torchtitan")
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not module.startswith(upper)
        for target in targets
        if target.startswith(upper)
    )
    assert upward == []
    # The study never reads the command-line tools either.
    assert [
        m for m, targets in graph.items() if m.startswith(upper[0]) and any(t.startswith(upper[1]) for t in targets)
    ] == []


def test_the_command_line_tools_are_thin():
    lengths = {path.name: len(path.read_text().splitlines()) for path in (ROOT / "torchtitan" / "tools").glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 250} == {}


# The top floor: packages by concern, and a few leaf modules that import nothing of the package but one another.
TOP_LEAVES = {"errors", "files", "logging", "moved"}


def test_the_top_floor_holds_packages_and_a_few_leaves():
    loose = {path.stem for path in (ROOT / "torchtitan").glob("*.py")} - {"__init__"}
    assert loose == TOP_LEAVES
    graph = import_graph(ROOT / "torchtitan")
    leaves = {f"torchtitan.{leaf}" for leaf in TOP_LEAVES}
    for leaf in sorted(leaves):
        assert graph[leaf] <= leaves, f"{leaf} is a leaf: it imports nothing of the package but the other leaves"


def upward_arrows(package_root: Path) -> list[str]:
    """Imports of a package that holds the importing module, other than to read one of its submodules
    (``from pkg import sub`` reads ``pkg.sub``; ``from pkg import name`` or ``import pkg`` reads ``pkg`` itself)."""
    modules = module_files(package_root)
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [alias.name for alias in node.names]
                targets = [node.module] if any(f"{node.module}.{n}" not in modules for n in names) else []
            else:
                continue
            found += [f"{module} imports {t}" for t in targets if t != module and module.startswith(t + ".")]
    return sorted(found)


def test_no_module_imports_a_package_above_it():
    assert upward_arrows(ROOT / "torchtitan") == []


def test_the_walk_finds_an_upward_arrow(tmp_path):
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "NAME = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from pkg import NAME\nfrom pkg.sub import b\n",
            "pkg/sub/b.py": "import pkg.sub\n",
        },
    )
    assert upward_arrows(package) == ["pkg.sub.a imports pkg", "pkg.sub.b imports pkg.sub"]
