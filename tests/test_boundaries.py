"""The house plan, kept by a test: what may import what (module-level AND function-level imports).

gateway/ never imports workers/; workers/ never imports gateway/; shared/ imports neither (its CLI package,
shared/cli/, the one place that wires both sides, aside); the engine (workers/engine, models, spec) never
imports workers/demo, bench, worker or tasks; and there is no import cycle between modules or packages.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("gateway", "workers", "shared")
ENGINE = ("workers.engine", "workers.models", "workers.spec")
NOT_FOR_THE_ENGINE = ("workers.demo", "workers.bench", "workers.worker", "workers.tasks")
CLI = "shared.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p for top in TOP_PACKAGES for p in sorted((ROOT / top).rglob("*.py")) if ".venv" not in p.parts
}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(imported project module, line) for every import statement anywhere in the module (function bodies too).
    `from a.b import c` names module a.b.c when that is a module, else a.b."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TOP_PACKAGES:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] not in TOP_PACKAGES:
                continue
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno


def graph() -> dict[str, set[str]]:
    return {m: {dep for dep, _ in imports_of(m) if dep in MODULES and dep != m} for m in MODULES}


def violations(importer_prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for module in MODULES:
        if not _within(module, importer_prefix) or any(_within(module, a) for a in allowed):
            continue
        for dep, line in imports_of(module):
            if any(_within(dep, f) for f in forbidden):
                found.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {dep}")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """The unit of the package-level check: gateway, shared, shared.cli, and each subpackage of workers."""
    parts = module.split(".")
    if parts[0] == "workers" and len(parts) > 2:
        return ".".join(parts[:2])
    if module.startswith(CLI + ".") or module == CLI:
        return CLI
    return parts[0] if parts[0] != "workers" else module


def test_the_walk_sees_every_side() -> None:
    assert {"gateway.main", "workers.engine.engine", "shared.keys", "shared.cli.main"} <= set(MODULES)
    # function-level imports are read too: the CLI imports the two sides inside its commands only
    deps = {dep for dep, _ in imports_of("shared.cli.fleet")}
    assert "workers.worker.main" in deps and "shared.cli.up" in deps


def test_gateway_never_imports_workers() -> None:
    assert violations("gateway", ("workers",)) == []


def test_workers_never_import_gateway() -> None:
    assert violations("workers", ("gateway",)) == []


def test_shared_imports_neither_side_but_its_cli() -> None:
    assert violations("shared", ("gateway", "workers"), allowed=(CLI,)) == []


def test_nothing_imports_the_cli() -> None:
    assert violations("gateway", (CLI,)) + violations("workers", (CLI,)) == []
    outside = [m for m in MODULES if _within(m, "shared") and not _within(m, CLI)]
    assert [m for m in outside if any(_within(dep, CLI) for dep, _ in imports_of(m))] == []


def test_the_engine_is_a_library() -> None:
    found = []
    for engine_package in ENGINE:
        found += violations(engine_package, NOT_FOR_THE_ENGINE)
    assert found == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(graph()) == []


def test_no_import_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for module, deps in graph().items():
        edges.setdefault(package_of(module), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(module)
        )
    assert cycles(edges) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
