"""The import graph has layers, and no arrow runs back up; the activity table is the one list of
activities that workflow, workers and history share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("kopt", "agents", "gpu_worker", "activities", "workflows")
# What each layer may import (of kopt's own packages). kopt.app (CLI, composition root, readers) is
# the front end on top; kopt itself is the ground floor of contracts.
ALLOWED = {
    "kopt": {"kopt"},
    "agents": {"kopt", "agents"},
    "gpu_worker": {"kopt", "gpu_worker"},
    "activities": {"kopt", "agents", "gpu_worker", "activities"},
    "workflows": {"kopt", "workflows"},  # and temporalio: the sandbox re-imports what workflow code uses
    "kopt.app": {"kopt", "kopt.app", "agents", "gpu_worker", "activities", "workflows"},
}


def layer(module: str) -> str | None:
    if module == "kopt.__main__" or module == "kopt.app" or module.startswith("kopt.app."):
        return "kopt.app"
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
    ("kopt.package", "def f():\n    from kopt.app import inspect\n"),
    ("gpu_worker.runner", "import agents.llm"),
    ("workflows.optimize", "from activities.build import BuildActivities"),
    ("agents.roles", "from gpu_worker import remote"),
])  # fmt: skip
def test_the_check_sees_an_arrow_back_up(module, source):
    assert violations(source, module), source


def test_every_activity_in_the_table_has_one_implementation_of_that_name():
    from temporalio import activity

    from activities import agents as agent_activities
    from activities.build import BuildActivities
    from activities.execution import ExecActivities
    from kopt.activity_table import ACTIVITIES
    from kopt.app.workers import implementations

    providers = {"agents": agent_activities, "build": BuildActivities, "exec": ExecActivities}
    registered = {}
    for kind, provider in providers.items():
        for fn in implementations(provider, kind):
            defn = activity._Definition.from_callable(fn)  # the name workers register it under
            registered[defn.name] = kind
    assert registered == {name: d.kind for name, d in ACTIVITIES.items()}
    with pytest.raises(RuntimeError, match="no implementation of activities"):
        implementations(object(), "build")
