"""The source of ``src/kvstrata`` read as a structure: modules, the imports between them (every
import statement, those inside functions and under ``TYPE_CHECKING`` included), classes and their
methods, attribute chains, ``getattr``/``hasattr`` calls. Read from the files' syntax trees, never
by importing them, so an import hidden in a function body counts like any other.

``tests/test_layers.py`` checks the project's structure rules with it; run this file to print
the current figures: ``python tests/structure.py``.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "kvstrata"
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class Module:
    name: str  # dotted: kvstrata.store.kvstore (a package is named by its __init__)
    path: Path
    tree: ast.Module = field(repr=False, compare=False)

    @property
    def rel(self) -> str:
        """The path under src/kvstrata/, as the offender lists spell it: ``store/kvstore.py``."""
        return self.path.relative_to(SRC / PACKAGE).as_posix()

    @property
    def lines(self) -> int:
        return len(self.path.read_text().splitlines())


@cache
def modules() -> dict[str, Module]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def _resolve(dotted: str) -> str | None:
    """The module of ours that importing ``dotted`` executes last: ``kvstrata.store.KVStore`` (a
    name in a package) is the package, ``kvstrata.store.kvstore`` the module."""
    mods = modules()
    while dotted and dotted not in mods:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


@cache
def imports() -> dict[str, frozenset[str]]:
    """Module -> the modules of ours it imports, anywhere in its body."""
    graph: dict[str, frozenset[str]] = {}
    for name, mod in modules().items():
        targets: set[str] = set()
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                targets.update(t for a in node.names if (t := _resolve(a.name)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = name.split(".") if mod.path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, base] if base else package)
                targets.update(t for a in node.names if (t := _resolve(f"{base}.{a.name}")))
        targets.discard(name)
        graph[name] = frozenset(t for t in targets if t.split(".")[0] == PACKAGE)
    return graph


def circles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), each an import circle."""
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ---- layers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    name: str
    packages: tuple[str, ...]
    """Dotted names; a module belongs to the layer of the longest package that contains it (the
    root package ``kvstrata`` holds only its own ``__init__``)."""
    what: str
    independent: bool = False
    """The packages of an independent layer never import each other."""


def layer_of(module: str, layers: tuple[Layer, ...]) -> tuple[int, str] | None:
    """(layer number, the package of it that holds ``module``); None when no layer names it."""
    best: tuple[int, str] | None = None
    for number, layer in enumerate(layers):
        for package in layer.packages:
            inside = module == package or (package != PACKAGE and module.startswith(package + "."))
            if inside and (best is None or len(package) > len(best[1])):
                best = (number, package)
    return best


def layer_violations(layers: tuple[Layer, ...]) -> set[tuple[str, str]]:
    """Imports that climb: (importer, imported) where the imported module is in a higher layer,
    or in another package of the same independent layer."""
    bad = set()
    for source, targets in imports().items():
        here = layer_of(source, layers)
        assert here is not None, f"{source} is in no layer"
        for target in targets:
            there = layer_of(target, layers)
            assert there is not None, f"{target} is in no layer"
            if there[0] > here[0] or (
                there[0] == here[0] and layers[here[0]].independent and there[1] != here[1]
            ):
                bad.add((source, target))
    return bad


def render_layers(layers: tuple[Layer, ...]) -> str:
    """The layers as docs/architecture.md shows them, top first."""
    lines = []
    for number in reversed(range(len(layers))):
        layer = layers[number]
        sep = " | " if layer.independent else ", "
        names = sep.join(p.removeprefix(PACKAGE + ".") if p != PACKAGE else PACKAGE for p in layer.packages)
        lines.append(f"{number + 1:>2} {layer.name:<10}  {names}")
        lines.append(f"   {'':<10}    {layer.what}")
    return "\n".join(lines)


# ---- classes, chains, probes --------------------------------------------------------------------


def classes(mod: Module) -> Iterator[ast.ClassDef]:
    yield from (node for node in ast.walk(mod.tree) if isinstance(node, ast.ClassDef))


def methods(cls: ast.ClassDef) -> list[str]:
    """The functions defined in the class body (properties and dunders included; not inherited)."""
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _module_names(mod: Module) -> set[str]:
    """Names bound to imported modules (``np``, ``os``): ``np.lib.stride_tricks.x`` is a module
    path, not a reach through objects."""
    names = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def attribute_chains(mod: Module, max_hops: int = 2) -> list[tuple[int, str]]:
    """(line, text) of each attribute chain of more than ``max_hops`` hops: ``self.a.b.c`` or
    ``x.a.b.c`` (three ``.name`` hops after the first name). A subscript does not break a chain
    (``self.a[i].b.c`` is three hops: a reach through a container); a call does (``self.a.b().c``
    is two hops, then one on the object the call returned). Chains that start at an imported module
    (``os.path.join``) are module paths and do not count."""
    skip = _module_names(mod)
    found = []
    inner: set[int] = set()  # attribute nodes already counted as part of an outer chain
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        hops = 0
        current: ast.expr = node
        while True:
            if isinstance(current, ast.Attribute):
                hops += 1
                inner.add(id(current))
                current = current.value
            elif isinstance(current, ast.Subscript):
                current = current.value
            else:
                break
        if hops > max_hops and not (isinstance(current, ast.Name) and current.id in skip):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def probes(mod: Module) -> list[tuple[int, str]]:
    """(line, text) of each capability probe: a ``getattr``/``hasattr`` of a literal name on an
    object (``getattr(disk, "open_batch", None)``). A probe of an imported module (a platform's
    ``os.O_DIRECT``) and a getattr of a computed name (a dataclass's fields) are no probes."""
    skip = _module_names(mod)
    found = []
    for node in ast.walk(mod.tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            continue
        root = node.args[0]
        while isinstance(root, ast.Attribute):
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in skip):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def back_pointers(mod: Module, owners: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, text) of each place an object hands itself, or one of ``owners``, to another: a
    parameter or field annotated with an ``owners`` name, or ``self`` passed as an argument (a
    back-pointer: the callee can reach everything its creator holds)."""
    skip = _module_names(mod)
    found = []
    for node in ast.walk(mod.tree):
        annotated = None
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotated = (node.arg, node.annotation)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name | ast.Attribute):
            annotated = (ast.unparse(node.target), node.annotation)
        if annotated is not None:
            words = re.findall(r"\w+", ast.unparse(annotated[1]))
            if set(words) & set(owners):
                found.append((node.lineno, f"{annotated[0]}: {ast.unparse(annotated[1])}"))
        arguments = [*node.args, *(k.value for k in node.keywords)] if isinstance(node, ast.Call) else []
        if any(isinstance(a, ast.Name) and a.id == "self" for a in arguments):
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            # getattr(self, name), object.__setattr__(self, ...), dataclasses.replace(self): no
            # collaborator keeps these
            if not (isinstance(root, ast.Name) and (root.id in _BUILTINS or root.id in skip)):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def rank_tables(mod: Module, enum_name: str) -> list[int]:
    """Lines of dict literals that map members of ``enum_name`` to integers (a rank table)."""
    found = []
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Dict) or len(node.keys) < 2:
            continue
        keys_ok = all(
            isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == enum_name
            for k in node.keys
        )
        values_ok = all(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in node.values)
        if keys_ok and values_ok:
            found.append(node.lineno)
    return found


def main() -> None:
    from test_layers import LAYERS  # the rules live beside the tests

    print("circles:")
    for circle in circles():
        print("   ", sorted(circle))
    print("imports that climb:")
    for source, target in sorted(layer_violations(LAYERS)):
        print(f"    {source} -> {target}")
    print("modules over 400 lines:")
    for mod in modules().values():
        if mod.lines > 400:
            print(f"    {mod.rel}: {mod.lines}")
    print("classes in store/ over 25 methods:")
    for mod in modules().values():
        if mod.rel.startswith("store/"):
            for cls in classes(mod):
                if len(methods(cls)) > 25:
                    print(f"    {mod.rel}:{cls.name}: {len(methods(cls))}")
    print("chains of more than two hops / getattr-hasattr in store/:")
    for mod in modules().values():
        if mod.rel.startswith("store/"):
            chains, probed = attribute_chains(mod), probes(mod)
            if chains or probed:
                print(f"    {mod.rel}: {len(chains)} chains, {len(probed)} probes")
    print()
    print(render_layers(LAYERS))


if __name__ == "__main__":
    main()
