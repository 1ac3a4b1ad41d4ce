"""The import graph has layers, and no arrow runs back up, and no circle; each top-level package says
what it holds; the activity table is the one list of activities that workflow, workers and history share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("kernels", "kopt", "containment", "agents", "gpu_worker", "activities", "workflows", "frontend")
# What each layer may import (of kopt's own packages), bottom to top: kernels (the packages' data and
# headers), kopt (contracts), containment (the jail, seccomp, the compiler), agents and gpu_worker,
# activities, workflows, frontend (CLI, composition root, readers).
ALLOWED = {
    "kernels": {"kernels"},
    "kopt": {"kopt", "kernels"},
    "containment": {"kopt", "kernels", "containment"},
    "agents": {"kopt", "agents"},
    "gpu_worker": {"kopt", "kernels", "containment", "gpu_worker"},
    "activities": {"kopt", "kernels", "containment", "agents", "gpu_worker", "activities"},
    "workflows": {"kopt", "workflows"},  # and temporalio: the sandbox re-imports what workflow code uses
    "frontend": set(PACKAGES),
}
ENTRY_POINTS = {"kopt.__main__"}  # `python -m kopt`: the front end's, though it sits in kopt/


def layer(module: str) -> str | None:
    if module in ENTRY_POINTS:
        return "frontend"
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def imports(source: str, module: str) -> list[str]:
    """Every kopt-package module `source` imports, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in found if layer(m) is not None]


def violations(source: str, module: str) -> list[str]:
    own = layer(module)
    out = []
    for target in imports(source, module):
        if layer(target) not in ALLOWED[own]:
            out.append(f"{module} imports {target} ({own} -> {layer(target)})")
    return sorted(set(out))


def modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            out.append((name, path))
    return out


def test_no_module_imports_from_a_layer_above_its_own():
    found = []
    for name, path in modules():
        found += violations(path.read_text(), name)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, source", [
    ("kopt.models", "from workflows.optimize import BEST_KEY"),
    ("kopt.package", "def f():\n    from frontend import inspect\n"),
    ("kopt.models", "from containment import jail"),
    ("containment.build", "from gpu_worker import static_checks"),
    ("gpu_worker.runner", "import agents.llm"),
    ("workflows.optimize", "from activities.build import BuildActivities"),
    ("agents.roles", "from gpu_worker import remote"),
])  # fmt: skip
def test_the_check_sees_an_arrow_back_up(module, source):
    assert violations(source, module), source


def module_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` counts as pkg.name where that
    is a module, else pkg)."""
    names = {name for name, _ in modules()}
    graph = {}
    for name, path in modules():
        deps = set()
        for target in imports(path.read_text(), name):
            while target not in names and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in names and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circle_of_imports_between_modules():
    """Function-level imports count: a circle they hide is still one part that needs the other both ways."""
    graph = module_graph()
    found = circles(graph)
    assert not found, found
    # (a package's __init__ is a module like any other: `import a.b` runs a/__init__ first)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_top_level_package_says_in_one_line_what_it_holds(pkg):
    doc = ast.get_docstring(ast.parse((REPO / pkg / "__init__.py").read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{pkg}/__init__.py: no docstring saying what it holds"


def test_every_activity_in_the_table_has_one_implementation_of_that_name():
    from temporalio import activity

    from activities import agents as agent_activities
    from activities.build import BuildActivities
    from activities.execution import ExecActivities
    from frontend.workers import implementations
    from kopt.activity_table import ACTIVITIES

    providers = {"agents": agent_activities, "build": BuildActivities, "exec": ExecActivities}
    registered = {}
    for kind, provider in providers.items():
        for fn in implementations(provider, kind):
            defn = activity._Definition.from_callable(fn)  # the name workers register it under
            registered[defn.name] = kind
    assert registered == {name: d.kind for name, d in ACTIVITIES.items()}
    with pytest.raises(RuntimeError, match="no implementation of activities"):
        implementations(object(), "build")
