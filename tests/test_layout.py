"""The package layout's import rules, read from the source with `ast` (nothing is imported):

- runtime/ never imports export/ (graph signatures live in graphs/, which both read);
- no installed module imports a measurement script (scripts/ is not installed);
- no import cycle among scripts/ modules (helpers they share live in a module of their own).

Every import counts, at module level or inside a function, absolute (`onegraph.export...`) or relative.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent          # the package directory: onegraph/


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """The onegraph modules `path` (a file under `root`, the package) imports, as dotted names."""
    package = ["onegraph", *path.relative_to(root).with_suffix("").parts[:-1]]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}      # `from . import x`: x may be a module
    return {m for m in out if m == "onegraph" or m.startswith("onegraph.")}


def test_imports_resolve_relative_forms(tmp_path):
    """The scanner itself: relative and absolute forms of one import give the same name."""
    d = tmp_path / "runtime"
    d.mkdir()
    f = d / "x.py"
    f.write_text("from ..export import entry\nfrom ..export.entry import graph_spec\nimport onegraph.export.trace\n"
                 "def g():\n    from .artifact import Artifact\n")
    got = imports(f, tmp_path)
    assert {"onegraph.export.entry", "onegraph.export", "onegraph.export.trace",
            "onegraph.runtime.artifact"} <= got


def test_runtime_never_imports_export():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m == "onegraph.export"
                                             or m.startswith("onegraph.export."))
           for p in sorted((ROOT / "runtime").rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, bad


def product_modules() -> dict[str, Path]:
    """{dotted name: file} of every installed module (tests/ and scripts/ are not installed)."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[0] in ("tests", "scripts"):
            continue
        out[".".join(["onegraph", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = p
    return out


def test_product_never_imports_a_script():
    bad = {m: sorted(i for i in imports(p) if i == "onegraph.scripts" or i.startswith("onegraph.scripts."))
           for m, p in product_modules().items()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_scripts_have_no_import_cycle():
    mods = {f"onegraph.scripts.{p.stem}": p for p in (ROOT / "scripts").glob("*.py") if p.stem != "__init__"}
    edges = {m: sorted(i for i in imports(p) if i in mods and i != m) for m, p in mods.items()}
    state, cycle = {}, []

    def visit(m, path):                     # depth-first search; state: 1 on the current path, 2 finished
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                cycle.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])
    assert not cycle, f"import cycles among scripts/: {cycle}"
