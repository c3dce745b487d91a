"""The import graph of ``bench/`` (read with ``ast``, nothing imported): no cycle, and the run-time harness
never imports the reporting package (only the command line, which sits above both, does)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"bench.cli", "bench.__main__"}  # above the harness and the reporting: may import both


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """Every ``bench`` module ``path`` imports, at any depth (function-level imports count too)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from . import claims` names a module
        else:
            continue
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me:
                out.add(n)
    return out


def bench_graph() -> nx.DiGraph:
    files = sorted((ROOT / "bench").rglob("*.py"))
    modules = {module_name(p) for p in files}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for p in files:
        g.add_edges_from((module_name(p), m) for m in imported(p, modules))
    return g


def test_the_walker_resolves_relative_and_from_package_imports(tmp_path):
    # arrange: the reporting writer imports sibling modules as `from . import claims`
    g = bench_graph()
    # act / assert
    assert g.has_edge("bench.report.leaderboards", "bench.report.claims")
    assert g.has_edge("bench.report.results", "bench.registry")
    assert g.has_edge("bench.recon_cells", "bench.figures")


def test_bench_imports_have_no_cycle():
    g = bench_graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles in bench/: {cycles[:5]}"


def test_the_harness_never_imports_reporting():
    g = bench_graph()
    bad = sorted(
        (a, b)
        for a, b in g.edges
        if b.startswith("bench.report") and not a.startswith("bench.report") and a not in ENTRY_POINTS
    )
    assert not bad, f"harness modules import the reporting package: {bad}"
    # and nothing of the harness reaches it indirectly (e.g. through a helper module)
    harness = [m for m in g if not m.startswith("bench.report") and m not in ENTRY_POINTS]
    reach = {m: sorted(d for d in nx.descendants(g, m) if d.startswith("bench.report")) for m in harness}
    assert not {m: r for m, r in reach.items() if r}
