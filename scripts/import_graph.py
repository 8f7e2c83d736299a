#!/usr/bin/env python3
"""The import graph of src/devbroker, checked: no cycles, no import up the layers.

Reads every module with `ast` (nothing is imported or run) and takes each
`import devbroker...` / `from devbroker... import` / relative import as an arrow from the
importing module to the imported one (a `from PKG import name` names the submodule when
there is one). Fails (exit 1) and says which when

- module-level imports form a cycle (imports inside functions are left out of this check:
  they run later, but are listed with --lazy; imports under `if TYPE_CHECKING:` never run
  and are left out too);
- the modules of one package of WHOLE_CYCLES form a cycle counting their imports inside
  functions as well (an import moved into a function hides a cycle from Python, not from a
  reader: the per-call modules of the broker must read bottom-up);
- a module imports (anywhere) one of a higher layer than its own (LAYERS below);
- a module of TOP_ONLY imports devbroker modules inside a function (its imports belong at
  the top, where a reader and this check see them);
- imports of any kind form a cycle: those inside functions (they run later) and those under
  `if TYPE_CHECKING:` (they never run) are arrows too, since a module that reaches another
  at call time or for its annotations depends on it all the same. Only the groups of
  CYCLE_EXEMPT are left out of this check, each with its reason;
- the packages (devbroker's subpackages, and each module directly under devbroker) form a
  cycle, counting every import: `broker` may use `sandbox`, or the other way, never both.

Usage: python3 scripts/import_graph.py [--lazy] [--dot] [--src DIR]
(tests/test_import_graph.py runs it; --src: another tree holding a devbroker package)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "devbroker"

# Lowest first. A module may import its own layer and those below; the first prefix that
# matches a module's dotted name (after "devbroker.") gives its layer.
LAYERS: list[tuple[str, ...]] = [
    ("abi", "sandbox", "native"),  # the driver ABI (sans-IO); the tenant's sandbox (Linux
    #                                syscalls, seccomp filters, the stat shim: it reaches a
    #                                broker through its sockets alone); the C parts' build
    ("backends",),                                                 # drivers: emulated, real
    ("broker",),                                                   # the core and its rules
    ("frontends", "oci.profile", "oci.state"),                     # how tenants reach it
    ("assemble", "daemon", "upgrade", "takeover", "oci"),          # a running broker
    ("cli", "escape", "testing", "tools", "data", "__main__", ""),  # programs and harnesses
]
# Arrows a lower layer may take upward, each with the reason (kept to a minimum).
ALLOWED_UP: dict[tuple[str, str], str] = {}
# Packages whose modules may not form a cycle even through imports inside functions.
WHOLE_CYCLES: tuple[str, ...] = ("devbroker.broker",)
# Modules whose devbroker imports are all at module level.
TOP_ONLY = frozenset({
    "devbroker.assemble", "devbroker.broker.core", "devbroker.broker.handlers",
    "devbroker.broker.interface", "devbroker.broker.refusal", "devbroker.broker.rewrite",
    "devbroker.broker.rules", "devbroker.backends.emulated",
    "devbroker.backends.emulated_controls",
})
# Groups of modules whose arrows among themselves are left out of the check on every
# import (not of the module-level one), each with its reason. Arrows into or out of a group
# count as usual. Remove a group once its modules import each other one way only.
CYCLE_EXEMPT: dict[frozenset[str], str] = {
    frozenset(f"devbroker.broker.{m}" for m in (
        "core", "fastlane", "continuelane", "handlers", "policy", "rewrite", "rules")):
        "the per-call routes, whose private calls into the core go both ways: folding them "
        "into one decision module and one executor dissolves this circle",
    frozenset({"devbroker.frontends.seccomp", "devbroker.frontends.nativelane"}):
        "the seccomp listener and its native loop's driver name each other's types; the "
        "same folding leaves the loop an executor that needs no listener",
}


def layer_of(module: str) -> int:
    rel = module[len(PKG) + 1:] if module.startswith(PKG + ".") else ""
    best, best_len = len(LAYERS) - 1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if p and (rel == p or rel.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((src / PKG).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return ((isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
            or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool | None]]:
    """(imported module, line, at module level) for each devbroker import of a module;
    None for "under `if TYPE_CHECKING:`" (for annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []

    def resolve(base: str, names: list[str], line: int, top: bool) -> None:
        hit = False
        for n in names:
            if f"{base}.{n}" in known:
                out.append((f"{base}.{n}", line, top))
                hit = True
        if not hit and base in known:
            out.append((base, line, top))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                # Names for annotations, never imported at run time: no module-level arrow
                # (no import cycle); the `else:` branch runs as usual.
                visit(ast.Module(body=child.body, type_ignores=[]), None)
                visit(ast.Module(body=child.orelse, type_ignores=[]), top)
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if top is None:
                inner = None
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        mod = a.name
                        while mod not in known and "." in mod:
                            mod = mod.rsplit(".", 1)[0]
                        out.append((mod, child.lineno, top))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    pkg = name if is_pkg else name.rsplit(".", 1)[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rsplit(".", 1)[0]
                    base = f"{pkg}.{child.module}" if child.module else pkg
                elif child.module and (child.module == PKG or child.module.startswith(PKG + ".")):
                    base = child.module
                else:
                    continue
                resolve(base, [a.name for a in child.names], child.lineno, top)
            visit(child, inner)

    visit(tree, True)
    return [(m, line, top) for m, line, top in out if m != name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def exempt(a: str, b: str) -> bool:
    """Whether the arrow a -> b lies inside one group of CYCLE_EXEMPT."""
    return any(a in group and b in group for group in CYCLE_EXEMPT)


def package_of(module: str, mods: dict[str, Path]) -> str:
    """devbroker.X for a module of the subpackage X, else the module (devbroker.daemon)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and mods[module].name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def every_import_problems(mods: dict[str, Path], edges: set[tuple[str, str]],
                          module_level: list[list[str]]) -> list[str]:
    """The cycles between packages and the cycles of every import (outside CYCLE_EXEMPT)
    other than the module-level ones, which are reported already."""
    every: dict[str, set[str]] = {m: set() for m in mods}
    packages: dict[str, set[str]] = {}
    for a, b in edges:
        if exempt(a, b):
            continue
        every[a].add(b)
        pa, pb = package_of(a, mods), package_of(b, mods)
        if pa != pb:
            packages.setdefault(pa, set()).add(pb)
            packages.setdefault(pb, set())
    out = ["package cycle (counting every import): " + " <-> ".join(comp)
           for comp in cycles(packages)]
    out += ["import cycle (counting imports inside functions and for annotations): "
            + " <-> ".join(comp) for comp in cycles(every) if comp not in module_level]
    return out


def check(src: Path = SRC, show_lazy: bool = False, dot: bool = False) -> int:
    mods = modules(src)
    known = set(mods)
    top: dict[str, set[str]] = {m: set() for m in mods}
    whole: dict[str, set[str]] = {m: set() for m in mods}  # WHOLE_CYCLES', lazy ones too
    problems: list[str] = []
    lazy: list[str] = []
    edges = set()
    for name, path in mods.items():
        for target, line, at_top in imports(name, path, known):
            edges.add((name, target))
            if at_top is not None and any(_within(name, p) and _within(target, p)
                                          for p in WHOLE_CYCLES):
                whole[name].add(target)
            if at_top:
                top[name].add(target)
            elif at_top is None:
                pass  # annotations only: no cycle, not a lazy import (the layer check stays)
            else:
                lazy.append(f"{path.relative_to(src.parent)}:{line}: {name} -> {target}")
                if name in TOP_ONLY:
                    problems.append(f"{path.relative_to(src.parent)}:{line}: {name} imports "
                                    f"{target} inside a function (TOP_ONLY)")
            up = layer_of(target) > layer_of(name)
            if up and (name, target) not in ALLOWED_UP:
                problems.append(f"{path.relative_to(src.parent)}:{line}: upward import "
                                f"{name} (layer {layer_of(name)}) -> {target} "
                                f"(layer {layer_of(target)})")
    found = cycles(top)
    for comp in found:
        problems.append("import cycle (module level): " + " <-> ".join(comp))
    for comp in cycles(whole):
        if comp not in found:
            problems.append("import cycle (counting imports inside functions): "
                            + " <-> ".join(comp))
    if dot:
        print("digraph devbroker {")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
    if show_lazy:
        print(f"{len(lazy)} imports inside functions:")
        print("\n".join(lazy))
    problems += every_import_problems(mods, edges, cycles(top))
    for p in problems:
        print(p, file=sys.stderr)
    print(f"import graph: {len(mods)} modules, {len(edges)} arrows, {len(problems)} problems",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    src = Path(args[args.index("--src") + 1]) if "--src" in args else SRC
    sys.exit(check(src, show_lazy="--lazy" in args, dot="--dot" in args))
