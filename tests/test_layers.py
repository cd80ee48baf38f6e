"""The structure rules the project keeps (issue 34), checked over the source's syntax trees
(``tests/structure.py``; imports inside functions and under ``TYPE_CHECKING`` count):

- no import circles in ``src/``;
- the layers below, bottom first: a module imports only from its own layer or lower ones, and the
  packages of an independent layer never import each other; docs/architecture.md shows them;
- no module in ``src/`` over 400 lines; no class in ``store/`` over 25 methods; ``KVStore`` has no
  mixins and at most 25 public methods;
- inside ``store/``: no attribute chain of more than two hops (``x.a.b.c``), no ``getattr`` /
  ``hasattr`` probe of a capability, no object handed the store (``KVStore``/``TieredStore``) or
  itself (``Demoter(self)``);
- ``import kvstrata.config`` loads neither torch nor redis;
- the priority rank and the codec loss rank are each defined once.

Each rule has a list of the places that still break it, one per line with its owner. A new
offender fails its test; so does an entry that no longer offends (delete it: the lists only
shrink). ``python tests/structure.py`` prints the current figures.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from structure import (
    ROOT,
    Layer,
    attribute_chains,
    back_pointers,
    circles,
    classes,
    layer_violations,
    methods,
    modules,
    probes,
    rank_tables,
    render_layers,
)

# The layers, bottom first. docs/architecture.md shows them (``render_layers``) between the markers
# ``<!-- layers -->`` and ``<!-- /layers -->``; run ``python tests/structure.py`` to print them.
LAYERS: tuple[Layer, ...] = (
    Layer(
        "foundation",
        (
            "kvstrata.errors",
            "kvstrata.layout",
            "kvstrata.keys",
            "kvstrata.priority",
            "kvstrata.crypto",
            "kvstrata.native",
            "kvstrata.runtime",
            "kvstrata.transfer",
            "kvstrata.tiering",
        ),
        "the vocabulary every part shares and platform helpers",
    ),
    Layer("codecs", ("kvstrata.codecs",), "pure encode/decode of one block"),
    Layer("policy", ("kvstrata.policy",), "pure scoring: eviction order, codec ladder, memory modes"),
    Layer("config", ("kvstrata.config",), "the store's frozen configuration"),
    Layer("store", ("kvstrata.store",), "KVStore and everything under it"),
    Layer(
        "model",
        ("kvstrata", "kvstrata.integrations"),
        "the package's public names (kvstrata/__init__.py); integrations.transformers: the model, its cache",
    ),
    Layer(
        "services",
        ("kvstrata.engine", "kvstrata.integrations.vllm", "kvstrata.eval"),
        "the engine; vLLM's connector; the quality evaluations",
        independent=True,
    ),
    Layer("apps", ("kvstrata.server", "kvstrata.demo"), "the HTTP server; the demo", independent=True),
    Layer("cli", ("kvstrata.cli",), "the kvstrata command's subcommands"),
    Layer("bench", ("kvstrata.bench",), "kvstrata bench's suites"),
    Layer("entry", ("kvstrata.cli.main", "kvstrata.cli.bench_cmd"), "the kvstrata command itself"),
)

# ---- what still breaks a rule: one entry a line, with its owner ----------------------------------

# Import circles, by their modules (without "kvstrata."). A circle that shrinks still matches.
KNOWN_CIRCLES: list[tuple[str, str]] = []

# Imports that climb a layer: "importer -> imported".
KNOWN_CLIMBS: list[tuple[str, str]] = []

MAX_MODULE_LINES = 400
KNOWN_LONG_MODULES: list[tuple[str, str]] = []

MAX_STORE_CLASS_METHODS = 25
KNOWN_BIG_STORE_CLASSES: list[tuple[str, str]] = []

MAX_KVSTORE_PUBLIC_METHODS = 25
# "mixins" (KVStore has base classes), "public methods" (more than the maximum, mixins counted)
KNOWN_KVSTORE_OFFENCES: list[tuple[str, str]] = []

# Attribute chains of more than two hops in store/ (see structure.attribute_chains), per module.
KNOWN_CHAINS: list[tuple[str, int, str]] = []

# getattr/hasattr probes of a literal name on an object in store/ (structure.probes), per module.
KNOWN_PROBES: list[tuple[str, int, str]] = []

# Objects handed the store or themselves in store/ (structure.back_pointers), per module.
KNOWN_BACK_POINTERS: list[tuple[str, int, str]] = []

# Heavy packages that `import kvstrata.config` loads.
KNOWN_CONFIG_IMPORTS: list[tuple[str, str]] = []

# Rank tables (a dict from every class to an int) outside their one home: "module enum".
RANK_HOMES = {"Priority": "priority.py", "CodecId": None}  # loss rank: a ClassVar on each codec
KNOWN_RANK_TABLES: list[tuple[str, str]] = []


def _compare(found: set[str], known: list[tuple[str, str]] | list[tuple[str, int, str]], what: str) -> None:
    listed = {entry[0] if len(entry) == 2 else f"{entry[0]}: {entry[1]}" for entry in known}
    new, gone = sorted(found - listed), sorted(listed - found)
    assert not new, f"new {what} (fix them; the lists only shrink): {new}"
    assert not gone, f"{what} no longer found: delete these entries from tests/test_layers.py: {gone}"


def _store_modules() -> list:
    return [m for m in modules().values() if m.rel.startswith("store/")]


def _short(module: str) -> str:
    return module.removeprefix("kvstrata.") if module != "kvstrata" else module


def test_no_new_import_circles() -> None:
    known = [frozenset(f"kvstrata.{m}" for m in entry.split()) for entry, _ in KNOWN_CIRCLES]
    found = circles()
    new = [sorted(map(_short, c)) for c in found if not any(c <= k for k in known)]
    assert not new, f"new import circles (function-level and TYPE_CHECKING imports count): {new}"
    gone = [e for (e, _), k in zip(KNOWN_CIRCLES, known, strict=True) if not any(c <= k for c in found)]
    assert not gone, f"circles no longer found: delete these entries from tests/test_layers.py: {gone}"


def test_imports_keep_the_layers() -> None:
    found = {f"{_short(a)} -> {_short(b)}" for a, b in layer_violations(LAYERS)}
    _compare(found, KNOWN_CLIMBS, "imports that climb a layer")


def test_every_module_is_in_a_layer() -> None:
    from structure import layer_of

    assert [m for m in modules() if layer_of(m, LAYERS) is None] == []


def test_the_architecture_page_shows_the_layers_the_checker_enforces() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"<!-- layers -->\s*```text\n(.*?)```\s*<!-- /layers -->", text, re.S)
    assert match, "docs/architecture.md has no ```text block between <!-- layers --> and <!-- /layers -->"
    assert match.group(1).rstrip("\n") == render_layers(LAYERS), (
        "docs/architecture.md's layers differ from tests/test_layers.py's LAYERS; paste the output of "
        "`python tests/structure.py` (the layers at its end)"
    )


def test_no_module_over_400_lines() -> None:
    found = {m.rel for m in modules().values() if m.lines > MAX_MODULE_LINES}
    _compare(found, KNOWN_LONG_MODULES, f"modules over {MAX_MODULE_LINES} lines")


def test_no_store_class_over_25_methods() -> None:
    found = {
        f"{m.rel}:{cls.name}"
        for m in _store_modules()
        for cls in classes(m)
        if len(methods(cls)) > MAX_STORE_CLASS_METHODS
    }
    _compare(found, KNOWN_BIG_STORE_CLASSES, f"classes in store/ over {MAX_STORE_CLASS_METHODS} methods")


def test_kvstore_is_a_thin_facade_without_mixins() -> None:
    (module,) = [m for m in _store_modules() if any(c.name == "KVStore" for c in classes(m))]
    (kvstore,) = [c for c in classes(module) if c.name == "KVStore"]
    found = set()
    if kvstore.bases:
        found.add("mixins")
    by_name = {cls.name: cls for m in _store_modules() for cls in classes(m)}
    names = set(methods(kvstore))
    for base in kvstore.bases:  # the mixins' methods are KVStore's too
        if isinstance(base, ast.Name) and base.id in by_name:
            names.update(methods(by_name[base.id]))
    public = sorted(n for n in names if not n.startswith("_"))
    if len(public) > MAX_KVSTORE_PUBLIC_METHODS:
        found.add("public methods")
    _compare(found, KNOWN_KVSTORE_OFFENCES, f"KVStore offences ({len(public)} public methods: {public})")


def _per_module(check, known: list[tuple[str, int, str]], what: str) -> None:
    details = {m.rel: check(m) for m in _store_modules()}
    found = {f"{rel}: {len(places)}" for rel, places in details.items() if places}
    listed = {f"{rel}: {n}" for rel, n, _ in known}
    changed = {entry.split(":")[0] for entry in found ^ listed}
    where = {rel: places for rel, places in details.items() if rel in changed and places}
    _compare(found, known, f"{what} (module: count; the changed ones' places: {where})")


def test_no_attribute_chains_of_more_than_two_hops_in_the_store() -> None:
    _per_module(attribute_chains, KNOWN_CHAINS, "attribute chains of more than two hops in store/")


def test_no_capability_probes_in_the_store() -> None:
    _per_module(probes, KNOWN_PROBES, "getattr/hasattr probes in store/")


def test_no_store_collaborator_holds_the_store_or_its_creator() -> None:
    # store/opening.py builds the placement and hands its parts out: the one module that holds
    # the TieredStore to do so (it is no collaborator)
    _per_module(
        lambda m: back_pointers(m, ("KVStore", "TieredStore")) if m.rel != "store/opening.py" else [],
        KNOWN_BACK_POINTERS,
        "objects handed the store or their creator in store/",
    )


def test_importing_the_config_loads_neither_torch_nor_redis() -> None:
    code = "import sys, kvstrata.config; print(' '.join(m for m in ('torch', 'redis') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    _compare(set(out.stdout.split()), KNOWN_CONFIG_IMPORTS, "heavy packages `import kvstrata.config` loads")


def test_priority_rank_and_loss_rank_are_defined_once() -> None:
    found = set()
    for m in modules().values():
        for enum_name, home in RANK_HOMES.items():
            if rank_tables(m, enum_name) and m.rel != home:
                found.add(f"{m.rel} {enum_name}")
    _compare(found, KNOWN_RANK_TABLES, "rank tables outside their home")


def test_every_codec_says_its_loss_rank() -> None:
    """The loss rank's one definition: a ClassVar on each codec class (0 exact, higher lossier)."""
    from kvstrata.codecs import _REGISTRY, loss_rank

    ranks = {cls.name: cls.__dict__.get("loss_rank") for cls in _REGISTRY.values()}
    assert all(isinstance(rank, int) for rank in ranks.values()), ranks
    assert [name for name, rank in ranks.items() if rank == 0] == ["identity", "lossless", "delta"]
    assert loss_rank("int8") < loss_rank("kivi4") < loss_rank("kvmix") < loss_rank("kivi2")


def test_every_offender_entry_names_an_owner() -> None:
    owners = {"refactor", "integrity", "recovery", "drain", "api", "pool", "ops"}
    lists = [
        KNOWN_CIRCLES,
        KNOWN_CLIMBS,
        KNOWN_LONG_MODULES,
        KNOWN_BIG_STORE_CLASSES,
        KNOWN_KVSTORE_OFFENCES,
        KNOWN_CHAINS,
        KNOWN_PROBES,
        KNOWN_BACK_POINTERS,
        KNOWN_CONFIG_IMPORTS,
        KNOWN_RANK_TABLES,
    ]
    assert [entry for known in lists for entry in known if entry[-1] not in owners] == []
