"""The package's layering: the pure core imports no torch, Ray or HTTP, and no import cycles.

Place: a check over the whole source tree (engine/, paraflex/, planner/, simulator/), read as
text with `ast`, plus one fresh interpreter that imports the pure packages.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from repo_paths import REPO

ROOTS = {"paraflex": "paraflex", "engine": "paraflex.engine", "planner": "paraflex.planner",
         "simulator": "paraflex.simulator"}
HEAVY = ("torch", "ray", "fastapi", "uvicorn", "starlette", "httpx", "triton")
PURE = ("paraflex.engine.core", "paraflex.planner", "paraflex.simulator")


def _modules() -> dict[str, object]:
    """Dotted module name -> path of every module of the package."""
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path, modules) -> set[str]:
    """Package modules `name` imports anywhere, function bodies included (only `if
    TYPE_CHECKING:` blocks are left out: they never run)."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs)  # `from pkg import submodule` depends on the submodule
            if len(subs) < len(node.names):
                found.add(node.module)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (c := dfs(v)):
                return c
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (c := dfs(u)):
            return c
    return None


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(len(v) for v in graph.values()) > 100  # the scan sees the real import graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_pure_core_imports_no_torch_ray_or_http():
    names = [n for n in _modules() if n.startswith(PURE)]
    code = ("import importlib, json, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert len(names) > 40
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
