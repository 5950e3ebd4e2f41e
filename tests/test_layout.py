"""The package layout's import rules, read from the source with `ast` (nothing is imported):

- no import cycle among installed modules but the op registry's (custom_ops/ registers its Triton lowerings,
  which import the ops they lower): a name two modules share lives in a module below both;
- runtime/ never imports export/ (graph signatures live in graphs/, which both read) nor server/ (the text
  codec and the CLI's serve defaults live in runtime/, so every command but `serve` runs without fastapi),
  commands/ or scripts/;
- `manifest.json` is opened only by runtime/artifact.py (the one reader; export writes through it too);
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


def test_runtime_never_imports_export_server_or_tools():
    banned = ("onegraph.export", "onegraph.server", "onegraph.commands", "onegraph.scripts")
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m in banned or m.startswith(banned_dot))
           for p in sorted((ROOT / "runtime").rglob("*.py")) for banned_dot in [tuple(b + "." for b in banned)]}
    assert not {k: v for k, v in bad.items() if v}, bad


def module_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the modules of `mods` it imports}; `from pkg import name` counts as pkg.name where that is a
    module (a sibling module, not the package's __init__)."""
    edges = {}
    for m, p in mods.items():
        got = imports(p)
        out = {i for i in got if i in mods and i != m}
        out -= {i for i in out if any(j.startswith(i + ".") and j in out for j in got)
                and not _imports_package_itself(p, i, m)}
        edges[m] = out
    return edges


def _imports_package_itself(path: Path, pkg: str, me: str) -> bool:
    """Whether `path` (module `me`) takes a name from package `pkg`'s __init__ (not only its submodules)."""
    mod_names = {p.stem for p in (ROOT / Path(*pkg.split(".")[1:])).glob("*.py")} | \
                {p.name for p in (ROOT / Path(*pkg.split(".")[1:])).iterdir() if p.is_dir()}
    package = ["onegraph", *path.relative_to(ROOT).with_suffix("").parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            if ".".join(base + ([node.module] if node.module else [])) == pkg and \
                    any(a.name not in mod_names for a in node.names):
                return True
        elif isinstance(node, ast.Import) and any(a.name == pkg for a in node.names):
            return True
    return False


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return out


def test_cycles_finds_a_circle():
    """The finder itself: a -> b -> a is one circle, c alone none."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle_but_the_op_registry():
    found = cycles(module_edges(product_modules()))
    # custom_ops/__init__ registers every op and its Triton lowering; the lowerings import their ops
    others = [c for c in found if not all(m == "onegraph.custom_ops" or m.startswith("onegraph.custom_ops.")
                                          for m in c)]
    assert not others, f"import cycles (move the shared name down a level): {others}"

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


def test_only_the_artifact_module_opens_the_manifest():
    """Every other module reads the manifest through runtime/artifact.py's Artifact (tests may read it)."""
    readers = sorted(str(p.relative_to(ROOT)) for p in product_modules().values()
                     if '"manifest.json"' in p.read_text() or "'manifest.json'" in p.read_text())
    assert readers == ["runtime/artifact.py"], readers
