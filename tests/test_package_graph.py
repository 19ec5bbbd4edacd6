"""One direction between batchlens' packages, read from the source's own imports (docs/architecture.md draws it).

Every ``import`` counts, a function's lazy one too: it is an edge at run time all the same. The command-line
layer (each package's ``command.py``, ``cli.py``, ``clikit.py``) sits above every package and is left out of
the package graph; ``clikit`` itself may read the config and nothing else.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


@cache
def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "batchlens").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def imports(module: str) -> frozenset[str]:
    """The batchlens modules ``module`` imports (``from a import b`` names a.b where b is a module)."""
    known, found = modules(), set()
    for node in ast.walk(ast.parse(known[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("batchlens"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("batchlens"))
    return frozenset(found & known.keys())


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def is_cli(module: str) -> bool:
    parts = module.split(".")
    return parts[-1] == "command" or module in ("batchlens.cli", "batchlens.clikit", "batchlens.__main__")


def package_edges() -> dict[str, set[tuple[str, str]]]:
    """package -> (package it imports, the importing module), the command-line layer left out."""
    edges = defaultdict(set)
    for module in modules():
        if is_cli(module):
            continue
        for target in imports(module):
            if package(target) != package(module):
                edges[package(module)].add((package(target), module))
    return edges


def cycles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> Iterator[list[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                yield from visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                yield sorted(component)

    for node in list(graph):
        if node not in index:
            yield from visit(node)


def test_no_two_packages_import_each_other_however_far_round() -> None:
    graph = {source: {target for target, _ in edges} for source, edges in package_edges().items()}
    assert list(cycles(graph)) == []


def test_no_two_modules_import_each_other_however_far_round() -> None:
    graph = {module: set(imports(module)) - {module} for module in modules()}
    assert list(cycles(graph)) == []


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("control", "remediation"),  # the controller's law is pure; its loop runs in the hook
        ("discovery", "exporter"),  # discovery lists pods; the exporter and the hook use it
        ("config", "exporter"),
        ("gpu_faults", "exporter"),
        ("goodput", "load"),
    ],
)
def test_a_lower_package_imports_nothing_from_a_higher_one(low: str, high: str) -> None:
    assert [module for target, module in package_edges()[low] if target == high] == []


def test_no_library_module_imports_the_command_line_and_clikit_imports_only_the_config() -> None:
    wrong = sorted(f"{m} -> {t}" for m in modules() if not is_cli(m) for t in imports(m) if is_cli(t))
    assert wrong == []
    assert {package(t) for t in imports("batchlens.clikit")} == {"config"}


def test_the_design_lives_in_the_repo_and_names_every_package() -> None:
    """docs/architecture.md, not a file outside the repository, is what the code cites; its table of layers names
    every package, so a new one must find its place there."""
    root = SRC.parent
    cited = [str(p.relative_to(root)) for folder in ("src", "tests", "scripts", "docs")
             for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".sh") and "node_modules" not in p.parts
             and p != Path(__file__) and "DESIGN.md" in p.read_text(errors="replace")]  # fmt: skip
    assert cited == []
    design = (root / "docs" / "architecture.md").read_text()
    packages = {package(m) for m in modules() if not is_cli(m)} - {"batchlens"}
    assert sorted(p for p in packages if f"`{p}`" not in design) == []
