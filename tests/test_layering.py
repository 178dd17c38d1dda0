"""The package's dependency rule, checked from the source: every ``import`` of every module of recstack/ (at the
top, inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module("recstack...")``) points at the
module's own layer or one below it, and no two packages import each other (directly or round a cycle).

A package is the first component below ``recstack``; the base modules are one group. Layers, lowest first:
base (errors, units, io, typed_toml, metrics, ``__init__``) < data < embedding < compression < models <
distributed < training (with ``recstack/config.py``) < serving, exfm, tune (one level: none imports another) < cli
(with ``__main__``). A new package or top-level module is a failure until it is given a layer here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "recstack"
LAYERS = [("base",), ("data",), ("embedding",), ("compression",), ("models",), ("distributed",), ("training",),
          ("serving", "exfm", "tune"), ("cli",)]
LEVEL = {group: i for i, groups in enumerate(LAYERS) for group in groups}
# Top-level modules -> their group (``recstack/<name>.py``).
MODULES = {"__init__": "base", "errors": "base", "units": "base", "io": "base", "typed_toml": "base",
           "metrics": "base", "config": "training", "__main__": "cli"}


@dataclass(frozen=True)
class Import:
    """One import statement of ``module`` (its path below recstack/) naming ``target`` (a dotted name)."""

    module: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"recstack/{self.module}:{self.line}: imports {self.target}"


def module_group(path: str) -> str | None:
    """The group of the module at ``path`` (relative to recstack/, such as ``data/loader.py``); None: no layer."""
    parts = path.split("/")
    if len(parts) > 1:
        return parts[0] if parts[0] in LEVEL else None
    return MODULES.get(parts[0].removesuffix(".py"))


def target_group(target: str) -> str:
    """The group a dotted name inside recstack belongs to: ``recstack.models.build`` -> models; a bare
    ``recstack`` or a name defined in ``recstack/__init__.py`` (``recstack.__version__``) -> base."""
    parts = target.split(".")
    if len(parts) == 1:
        return "base"
    if parts[1] in LEVEL:
        return parts[1]
    return MODULES.get(parts[1], "base")


def imports(path: str, source: str) -> list[Import]:
    """Every import of recstack inside the module at ``path`` (relative to recstack/), wherever it stands."""
    package = ["recstack", *path.removesuffix(".py").split("/")]
    package.pop()  # relative imports start at the module's package (for an __init__.py: the package itself)
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from recstack import data`` names the package data; ``from recstack.x import y`` stays in x
            names = [f"{base}.{a.name}" for a in node.names] if base == "recstack" else [base]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module",
                                                                                           "__import__")):
            names = [node.args[0].value]
        found += [Import(path, n, node.lineno) for n in names if n == "recstack" or n.startswith("recstack.")]
    return found


def layer_violations(sources: dict[str, str]) -> list[str]:
    """What breaks the rule in ``sources`` (path below recstack/ -> source text): a module outside every layer,
    an import of a higher layer or of a sibling on the same level, and import cycles between groups."""
    problems = []
    edges: dict[tuple[str, str], list[Import]] = {}
    for path, source in sorted(sources.items()):
        group = module_group(path)
        if group is None:
            problems.append(f"recstack/{path}: in no layer (give its package a place in tests/test_layering.py)")
            continue
        for imp in imports(path, source):
            target = target_group(imp.target)
            if target == group:
                continue
            edges.setdefault((group, target), []).append(imp)
            if LEVEL[target] >= LEVEL[group]:
                where = "above" if LEVEL[target] > LEVEL[group] else "beside"
                problems.append(f"{imp}: layer {target} is {where} {group}")
    for cycle in group_cycles(set(edges)):
        # the imports that close it: those that point up or beside (the downward ones are allowed)
        links = [str(imp) for (a, b), found in sorted(edges.items())
                 if a in cycle and b in cycle and LEVEL[b] >= LEVEL[a] for imp in found]
        problems.append(f"import cycle between {', '.join(cycle)}, closed by:\n    " + "\n    ".join(links))
    return problems


def group_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The groups that import each other round a cycle: each strongly connected set of two or more, sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    reach = {g: _reachable(graph, g) for g in graph}
    cycles = {tuple(sorted(h for h in reach[g] if g in reach[h])) for g in graph if g in reach[g]}
    return sorted(list(c) for c in cycles)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Groups reachable from ``start`` by one or more edges."""
    out: set[str] = set()
    todo = list(graph[start])
    while todo:
        g = todo.pop()
        if g not in out:
            out.add(g)
            todo += graph[g]
    return out


def package_sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_imports_a_higher_layer_and_no_package_cycle() -> None:
    problems = layer_violations(package_sources())
    assert not problems, "the package layering is broken:\n" + "\n".join(problems)


SYNTHETIC = {
    "__init__.py": '__version__ = "1"\n',
    "errors.py": "class Error(Exception): ...\n",
    "data/__init__.py": "",
    "data/loader.py": "from recstack.errors import Error\nfrom recstack import __version__\n",
    "data/inspect.py": "def f():\n    from recstack.models.build import build_model\n",
    "models/build.py": "from ..data.loader import Loader\nfrom . import dlrm\n",
    "models/dlrm.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recstack.data import batch\n",
    "exfm/run.py": "import recstack.serving.server\n",
    "serving/server.py": "import importlib\nimportlib.import_module('recstack.training.trainer')\n",
    "training/trainer.py": "from recstack import models, errors\nimport recstack.config\n",
    "config.py": "from recstack.training import trainer\n",
    "gadgets/x.py": "",
}


def test_the_checker_finds_every_kind_of_violation() -> None:
    problems = layer_violations(SYNTHETIC)
    joined = "\n".join(problems)
    assert "recstack/data/inspect.py:2: imports recstack.models.build: layer models is above data" in joined  # lazy
    assert "recstack/exfm/run.py:1: imports recstack.serving.server: layer serving is beside exfm" in joined
    assert "recstack/serving/server.py:2: imports recstack.training.trainer" not in joined  # a lower layer: fine
    assert "recstack/gadgets/x.py: in no layer" in joined
    assert "import cycle between data, models" in joined
    assert len(problems) == 4, joined  # training <-> config is one group; base imports and TYPE_CHECKING are fine
    fixed = {k: v for k, v in SYNTHETIC.items() if k not in ("data/inspect.py", "exfm/run.py", "gadgets/x.py")}
    assert layer_violations(fixed) == []


def test_imports_are_found_wherever_they_stand() -> None:
    found = imports("models/dlrm.py", SYNTHETIC["models/dlrm.py"])
    assert [(i.target, i.line) for i in found] == [("recstack.data", 3)]
    found = imports("training/trainer.py", SYNTHETIC["training/trainer.py"])
    assert sorted(i.target for i in found) == ["recstack.config", "recstack.errors", "recstack.models"]
    assert [target_group(i.target) for i in sorted(found, key=lambda i: i.target)] == ["training", "base", "models"]
    found = imports("models/build.py", SYNTHETIC["models/build.py"])
    assert [(i.target, i.line) for i in found] == [("recstack.data.loader", 1), ("recstack.models", 2)]
    found = imports("data/__init__.py", "from .loader import x\nfrom .. import errors\n")
    assert sorted(i.target for i in found) == ["recstack.data.loader", "recstack.errors"]


@pytest.mark.parametrize(("edges", "cycles"), [
    ({("a", "b"), ("b", "c"), ("c", "a")}, [["a", "b", "c"]]),
    ({("a", "b"), ("b", "c")}, []),
    ({("a", "b"), ("b", "a"), ("b", "c"), ("c", "b"), ("d", "e"), ("e", "d"), ("c", "d")},
     [["a", "b", "c"], ["d", "e"]]),
])
def test_cycles_between_groups(edges: set[tuple[str, str]], cycles: list[list[str]]) -> None:
    assert group_cycles(edges) == cycles
