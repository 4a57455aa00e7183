"""The walls between packages: the package import graph (every import, module level or inside a
function) has no cycles, and `pallas_kernels` is a library that imports nothing from `jaxserve`.

A node is a subpackage of jaxserve (core, model, runtime, server, ...), a top-level module of it
(cli, engine, tokenizer, ...) or `pallas_kernels`. KNOWN_CYCLES lists the cycles not yet broken (as
strongly connected components); the test fails when the graph's cycles differ from it: a new cycle,
or a listed one broken (then shrink the list here)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# None left: issue 25 broke model <-> runtime (the runner, lowering and compile commands moved up to
# `worker`, the per-parameter sharding rules to model/sharding.py, cache_dir to jaxserve/paths.py).
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def node_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "pallas_kernels"
    if parts[0] != "jaxserve":
        return None
    return parts[1] if len(parts) > 1 else "jaxserve"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path):
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from jaxserve import engine` names a module; `from jaxserve.x import y` names x
            if target == "jaxserve":
                yield from (f"jaxserve.{a.name}" for a in node.names)
            else:
                yield target


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in [*ROOT.glob("jaxserve/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]:
        src = node_of(module_name(path))
        for target in imported_modules(path):
            dst = node_of(target)
            if dst and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each strongly connected component of more than one node, as a sorted tuple (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
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
                out.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_package_import_graph_has_only_the_known_cycles():
    assert cycles(package_graph()) == KNOWN_CYCLES


def test_pallas_kernels_imports_nothing_from_jaxserve():
    assert "jaxserve" not in {node_of(m) for m in package_graph().get("pallas_kernels", ())}
    assert not [m for p in ROOT.glob("pallas_kernels/**/*.py") for m in imported_modules(p)
                if m.startswith("jaxserve")]
