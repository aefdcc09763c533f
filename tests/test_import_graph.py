"""The import graph of moekv: no cycle among its modules, and the low layers never import the high ones.

Every moekv/**/*.py is parsed with `ast`; module-level and function-level imports both count (a
function-level import hides a cycle from Python, not from the design).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "moekv"
LOW_LAYERS = ("ops", "layers", "kvcache", "routing", "models", "engine", "experts")
HIGH_LAYERS = ("moekv.llm", "moekv.cli", "moekv.server", "moekv.tools")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The moekv modules `path` imports anywhere in its body (`from pkg import name` counts as
    pkg.name when that is a module, else as pkg)."""
    name = module_name(path)
    package = name if is_package(path) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import moekv.a.b` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target.startswith("moekv") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, known) for p in paths}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("cycle among: " + ", ".join(component))
        for v in component:
            lines.append(f"  {v} -> {sorted(graph[v] & members)}")
    return "\n".join(lines)


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_parser_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "moekv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from moekv.sub import b\n    from . import c\n")
    for name in ("b", "c"):
        (pkg / "sub" / f"{name}.py").write_text("")
    known = {"moekv", "moekv.sub", "moekv.sub.a", "moekv.sub.b", "moekv.sub.c"}
    global PACKAGE_ROOT
    saved, PACKAGE_ROOT = PACKAGE_ROOT, pkg
    try:
        assert imported_modules(pkg / "sub" / "a.py", known) == {"moekv.sub.b", "moekv.sub.c"}
    finally:
        PACKAGE_ROOT = saved


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        if module.split(".")[1:2] and module.split(".")[1] in LOW_LAYERS:
            bad += [f"{module} -> {t}" for t in sorted(targets)
                    if any(t == high or t.startswith(high + ".") for high in HIGH_LAYERS)]
    return bad


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, describe(cycles, graph)


def test_low_layers_never_import_the_high_ones():
    bad = layering_violations(import_graph())
    assert not bad, "\n".join(bad)


def private_imports() -> list[str]:
    """`from moekv.x import _name` anywhere in moekv/: a module reaching into another's private names."""
    bad = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moekv"):
                bad += [f"{module_name(path)}: from {node.module} import {alias.name}" for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")]
    return bad


def test_no_module_imports_another_modules_private_names():
    bad = private_imports()
    assert not bad, "\n".join(bad)


GLUON_SHARED = {"common", "tables", "two_bit", "checks", "launch", "splits", "prefetch"}
GLUON_ALSO = {"tiered": {"fp8", "nuq2"}}  # tiered = fp8 pages + nuq2 pages


def test_each_format_s_gluon_files_import_only_the_shared_ones_and_their_own():
    """moekv/ops/gluon/<fmt>_*.py import, of moekv.ops.gluon, only the shared modules and their own
    format's files (tiered: fp8's and nuq2's too)."""
    graph = import_graph()
    bad = []
    for module, targets in sorted(graph.items()):
        if not module.startswith("moekv.ops.gluon.") or module.rpartition(".")[2] in GLUON_SHARED:
            continue
        fmt = module.rpartition(".")[2].split("_")[0]
        for target in sorted(t for t in targets if t.startswith("moekv.ops.gluon.")):
            name = target.rpartition(".")[2]
            if name not in GLUON_SHARED and name.split("_")[0] not in {fmt} | GLUON_ALSO.get(fmt, set()):
                bad.append(f"{module} -> {target}")
    assert not bad, "\n".join(bad)


def test_config_imports_nothing_of_the_engine():
    """moekv/config.py is read by everything that builds an engine and by the command line's --help:
    it imports no moekv.engine module (the torchrun environment it checks comes from moekv.envs)."""
    bad = sorted(t for t in import_graph()["moekv.config"] if t == "moekv.engine" or t.startswith("moekv.engine."))
    assert not bad, bad
