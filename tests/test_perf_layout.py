"""research/perf/ is layered: data and mechanisms below the code that fits or checks them, no
import circle (every import counts, those inside functions and package ``__init__`` files
included), and no file past what one reads in a sitting."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PERF = ROOT / "research" / "perf"
MAX_LINES = 450


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PERF) -> dict[str, set[str]]:
    """Module -> the research.perf modules it imports anywhere in its body (inside functions
    too). An import names its most specific module: ``from a.b import c`` is an edge to the
    module ``a.b.c`` where there is one, else to ``a.b`` (a package ``__init__`` when ``a.b`` is
    a package: its re-exported names are its own edges)."""
    modules = {_module(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_cycle_finder_finds_a_circle_through_a_package_init(tmp_path):
    pkg = tmp_path / "research" / "perf"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engines" / "__init__.py").write_text("from research.perf.engines.serving import x\n")
    (pkg / "engines" / "serving.py").write_text("def f():\n    from research.perf import fit\n")
    (pkg / "fit.py").write_text("from research.perf.engines import P\n")
    (pkg / "engines" / "profiles.py").write_text("P = 1\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = cycles(import_graph(pkg))
    finally:
        ROOT = saved
    assert found == [
        ["research.perf.engines", "research.perf.engines.serving", "research.perf.fit"]
    ]


def test_no_import_circle_in_perf():
    found = cycles(import_graph())
    assert not found, f"import circles in research/perf: {found}"


def test_no_perf_file_past_a_sitting():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PERF.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by responsibility (> {MAX_LINES} lines): {long}"
