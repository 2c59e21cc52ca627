"""The package's shape, enforced: a sealed tier seam, torch only in ``dcp/`` (and the framework adapters
in ``integrations/``, which sit on it), dependencies one way, no
import circle, and a writer's or reader's private state touched by its own class only."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tierstore"
SEAM = {"tierstore.tiers", "tierstore.tiers.base", "tierstore.tiers.registry"}
"""What code outside tierstore/tiers/ may import from it: the seam, never an adapter module."""

LAYERS = {
    "tierstore._platform": 0,
    **dict.fromkeys(
        [
            "tierstore." + m
            for m in ("errors", "version", "ids", "units", "checksum", "signing", "topology", "interval")
        ],
        0,
    ),
    **dict.fromkeys(["tierstore.testing", "tierstore.placement"], 0),
    "tierstore.tiers": 1,
    "tierstore.config": 2,
    "tierstore.policy_config": 2,
    "tierstore.records": 3,
    "tierstore.dcp": 5,
    "tierstore.promote": 5,
    "tierstore.cli": 6,
    "tierstore.integrations": 6,
    "tierstore": 6,
}
"""_platform and the vocabulary -> tiers -> config -> records -> {dcp, promote} -> {cli, integrations}."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once per test process (every test here walks them all)."""
    return ast.parse(path.read_text(), str(path))


def modules() -> list[tuple[str, ast.Module]]:
    return [(module_name(path), parsed(path)) for path in sorted(PACKAGE.rglob("*.py"))]


def imports(tree: ast.AST) -> list[tuple[str, list[str], bool]]:
    """``(module, names, at module level)`` for every import (TYPE_CHECKING blocks excluded)."""
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # type-only imports run nothing
            if isinstance(child, ast.Import):
                found.extend((alias.name, [], top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append((child.module, [a.name for a in child.names], top))
            inside = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, top and not inside)

    visit(tree, True)
    return found


def layer_of(module: str) -> int:
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return LAYERS[module]


def subpackage(module: str) -> str:
    """``tierstore.dcp.save.writer`` -> ``dcp``; ``tierstore.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_placed_in_a_layer() -> None:
    for name, _tree in modules():
        layer_of(name)  # raises KeyError for a module the picture does not show


def test_nothing_outside_tiers_imports_an_adapter() -> None:
    offenders = []
    for name, tree in modules():
        if name.startswith("tierstore.tiers"):
            continue
        for module, names, _top in imports(tree):
            if module.startswith("tierstore.tiers") and module not in SEAM:
                offenders.append(f"{name} imports {module}")
            if module in SEAM:
                offenders += [f"{name} imports {n}" for n in names if n.endswith("Tier") and n != "Tier"]
    assert offenders == [], "ask the tier for a capability or call a verb instead"


def test_nothing_outside_tiers_reaches_around_the_seam_to_a_tiers_files() -> None:
    """A tier's real paths stay inside ``tierstore/tiers/``: a caller that needs a file mapped, a
    directory of its own or a file landed asks the tier's local face for the verb (``map_file``,
    ``own_directory``, ``open_landing``), which a tier without local files does not have."""
    offenders = []
    for name, tree in modules():
        if name.startswith("tierstore.tiers"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "local_path":
                offenders.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Name | ast.alias) and "hold_owner_lock" in ast.unparse(node):
                offenders.append(f"{name}:{getattr(node, 'lineno', '?')} locks a directory")
    assert offenders == [], offenders


def test_only_dcp_imports_torch_at_module_level_and_promote_never() -> None:
    """``integrations/`` adapts torch frameworks (torchtitan's checkpointer is a torch object) on top of
    the DCP face; nothing imports it, so the CLI and the promoter still never load torch."""
    offenders = []
    for name, tree in modules():
        for module, _names, top in imports(tree):
            if module.split(".")[0] != "torch":
                continue
            torch_side = name.startswith(("tierstore.dcp", "tierstore.integrations"))
            if name.startswith("tierstore.promote") or (top and not torch_side):
                offenders.append(f"{name} imports {module}")
    assert offenders == []


MUTATING_VERBS = {"publish", "delete", "delete_tree", "remove_if_empty", "discard_incomplete", "write_bytes"}
"""Tier verbs that change records (markers, log entries, part records, mirror markers, the stamp) or
drop a generation; data is written through ``open_write``, ``adopt`` and ``open_landing``."""


def _record_mutations(tree: ast.AST) -> list[int]:
    """Lines that call a mutating tier verb or the change stamp, except ``write_bytes`` of a
    checkpoint's own data file (``checkpoint_file(...)``: DCP's ``.metadata``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        data = name == "write_bytes" and node.args and "checkpoint_file(" in ast.unparse(node.args[0])
        if (isinstance(node.func, ast.Attribute) and name in MUTATING_VERBS and not data) or name == "touch":
            found.append(node.lineno)
    return found


def test_only_the_records_package_changes_commit_records() -> None:
    """The commit protocol is written once: a marker, a log entry, a part record, a mirror marker,
    a change stamp or a generation's removal is changed only by ``tierstore/records/`` (its one
    executor and the record modules), never beside it."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name.startswith(("tierstore.records", "tierstore.tiers")):
            continue
        offenders += [f"{name}:{line}" for line in _record_mutations(parsed(path))]
    assert offenders == [], offenders


def test_the_record_check_sees_each_mutating_call() -> None:
    """The check above can fail: each verb, the stamp, and a record write are seen; a data write is not."""
    code = (
        "tier.publish(p, b'', create_only=True)\ntier.delete(p)\ntier.delete_tree(p)\n"
        "tier.remove_if_empty(p)\ntier.discard_incomplete(w)\ntier.write_bytes(part, b'')\ntouch(tier)\n"
        "tier.write_bytes(checkpoint_file(i, m), b'')\ntier.open_write(p)\n"
    )
    assert _record_mutations(ast.parse(code)) == [1, 2, 3, 4, 5, 6, 7]


def test_only_the_executor_performs_record_effects_in_records() -> None:
    """Inside ``records/``, the commit records (markers, log and void entries, part records, mirror
    markers, generation data) change only in ``protocol.py``, the executor; the record modules
    write only their own records (activity, sightings, conflicts, status, clock, stamp, lease, index,
    sweep)."""
    own = {
        "activity",
        "sightings",
        "conflicts",
        "mirror",
        "promoter_state",
        "clock",
        "changes",
        "lease",
        "index",
        "sweeps",
    }
    offenders = []
    for path in sorted((PACKAGE / "records").glob("*.py")):
        if path.stem in own or path.stem in {"protocol", "__init__"}:
            continue
        offenders += [f"{path.stem}:{line}" for line in _record_mutations(parsed(path))]
    assert offenders == [], offenders


def test_dependencies_flow_one_way_with_no_lazy_imports_against_it() -> None:
    offenders = []
    for name, tree in modules():
        for module, _names, _top in imports(tree):
            if not module.startswith("tierstore") or name == "tierstore":
                continue  # the package root re-exports lazily by name (PEP 562), on purpose
            if layer_of(module) > layer_of(name):
                offenders.append(f"{name} (layer {layer_of(name)}) imports {module}")
            if {subpackage(name), subpackage(module)} == {"dcp", "promote"}:
                offenders.append(f"{name} imports {module}: the DCP face and the sidecar are peers")
    assert offenders == []


def import_graph(sources: dict[str, ast.Module], packages: set[str]) -> dict[str, set[str]]:
    """``module -> the modules of sources it imports``, at module level, in functions and under
    TYPE_CHECKING alike. ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one,
    else to ``a.b`` (its face). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first;
    those implicit edges are not counted: a face importing its own modules would close a circle
    with each of them."""
    graph: dict[str, set[str]] = {}
    for name, tree in sources.items():
        package = (name if name in packages else name.rpartition(".")[0]).split(".")
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) + 1 - node.level] if node.level else []  # relative: up
                module = ".".join([*base, *([node.module] if node.module else [])])
                found |= {
                    f"{module}.{a.name}" if f"{module}.{a.name}" in sources else module for a in node.names
                }
        graph[name] = found & set(sources) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Circles in ``graph``, each as ``a -> b -> a``; at least one for every group of modules that
    import each other (a depth-first walk meets each group through a back edge)."""
    cycles: list[str] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return cycles


def test_no_import_circle_in_the_package() -> None:
    """No module imports itself back through others: not at run time, not from inside a function,
    not for a type annotation only (a circle there still ties the modules into one)."""
    sources = dict(modules())
    packages = {module_name(path) for path in PACKAGE.rglob("__init__.py")}
    assert import_cycles(import_graph(sources, packages)) == []


def test_the_circle_check_sees_type_only_and_function_level_imports() -> None:
    """The check above can fail: a circle closed by a TYPE_CHECKING import, one closed inside a
    function, one through a relative import; a package importing its own modules is none."""
    code = {
        "p": "from p.a import A\n",
        "p.a": "from p.b import B\n",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\n",
        "p.c": "def f():\n    from p import d\n",
        "p.d": "import p.c\n",
        "p.e": "from . import f\n",
        "p.f": "from .e import E\n",
        "p.g": "from p.a import A\n",
    }
    graph = import_graph({name: ast.parse(text) for name, text in code.items()}, {"p"})
    assert import_cycles(graph) == ["p.a -> p.b -> p.a", "p.c -> p.d -> p.c", "p.e -> p.f -> p.e"]


OWNERS = {"tierstore.dcp.save.writer": "TieredWriter", "tierstore.dcp.restore.reader": "TieredReader"}
"""The modules that may touch a writer's or reader's private state: their own classes'."""


def _private_names(tree: ast.Module, class_name: str) -> set[str]:
    """The private attributes and methods of ``class_name`` (``self._x``, ``def _x``, ``_x = ...``)."""
    found: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name):
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                found.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.Name):
                found.add(node.name if isinstance(node, ast.FunctionDef) else node.id)
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def _reaches_into(tree: ast.AST, private: set[str]) -> list[int]:
    """Lines that touch a private attribute of a writer, a reader or a session from outside:
    ``writer._x``, ``reader._x``, ``session._x`` (``self.writer._x`` too), or one of ``private`` on
    anything but ``self``/``cls``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if owner in {"writer", "reader", "session"} or (
            owner not in {"self", "cls"} and node.attr in private
        ):
            found.append(node.lineno)
    return sorted(found)


def test_only_the_writer_and_the_reader_touch_their_private_state() -> None:
    """A save's and a load's state travel as a session to each step: no module reaches into the
    writer's, the reader's or a session's private fields (``TieredWriter``/``TieredReader`` keep
    only per-process state, touched by their own methods)."""
    trees = dict(modules())
    private = set().union(*(_private_names(trees[name], cls) for name, cls in OWNERS.items()))
    assert {"_session", "_checkpoint_id", "_staged", "_prober"} <= private, "the owners moved?"
    offenders = [
        f"{name}:{line}"
        for name, tree in trees.items()
        if name not in OWNERS
        for line in _reaches_into(tree, private)
    ]
    assert offenders == [], offenders


def test_the_private_state_check_sees_each_reach() -> None:
    """The check above can fail: each name's reach, a nested one, and the owners' private names on
    another object are seen; ``self``'s own and public attributes are not."""
    code = (
        "writer._slab = s\nreader._count(1)\nsession._lock\nself.writer._x\nw._session\nmake()._tier\n"
        "self._tier\nwriter.tier\nwriter.__class__\nsession.reading\nother._other\n"
    )
    assert _reaches_into(ast.parse(code), {"_session", "_tier"}) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "modules_to_import", ["tierstore, tierstore.cli", "tierstore.promote.sidecar, tierstore.promote.cleanup"]
)
def test_the_cli_and_the_promoter_run_without_loading_torch(modules_to_import: str) -> None:
    code = f"import sys, {modules_to_import}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_importing_tierstore_loads_no_training_framework() -> None:
    """The adapters are imported by name: ``import tierstore`` never pulls in torchtitan."""
    code = "import sys, tierstore, tierstore.integrations; print('torchtitan' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _layout_block() -> str:
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    section = design.split("## Package layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_design_docs_file_map_names_every_module_and_only_modules_that_exist() -> None:
    """docs/design.md's package layout is the map a newcomer reads: every module and subpackage is
    on it, and nothing on it is gone."""
    block = _layout_block()
    named = set(re.findall(r"\b([a-z_0-9]+\.py)\b", block))
    dirs = set(re.findall(r"\b([a-z_0-9]+)/", block))
    files = {p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    packages = {p.parent.name for p in PACKAGE.rglob("__init__.py")}
    assert sorted(files - named) == [], "modules missing from docs/design.md's package layout"
    assert sorted(named - files) == [], "docs/design.md's package layout names modules that are gone"
    assert sorted(packages - dirs) == [], "packages missing from docs/design.md's package layout"


def test_no_module_reads_thread_stacks() -> None:
    """Back-pressure follows explicit signals (a thread's end, DCP's end-of-save event, the staged
    tensors' release), never the interpreter's private view of other threads' frames."""
    readers = [
        path.relative_to(PACKAGE.parent).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_current_frames" in path.read_text() or "f_back" in path.read_text()
    ]
    assert readers == []


def _benchmark_imports() -> dict[str, set[str]]:
    """benchmarks/ module -> the benchmarks modules it imports anywhere (top level, in functions,
    under TYPE_CHECKING)."""
    folder = PACKAGE.parent / "benchmarks"
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                found.add(node.module or "")
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("benchmarks.")}
        graph[f"benchmarks.{path.stem}"] = found
    return graph


def test_benchmarks_import_each_other_without_cycles() -> None:
    """A phase never imports the runner that imports it (not even lazily or for types)."""
    graph = _benchmark_imports()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported in graph:
                visit(imported, [*path, imported])

    for module in graph:
        visit(module, [module])
    assert cycles == []


POLICY_FIELDS = {"keep", "keep_every", "pin", "every"}
"""A tier's retention and promotion fields: configuration's (:mod:`tierstore.policy_config`), read
by the promoter's rules, never by a tier."""


def test_tier_configs_declare_no_policy_fields() -> None:
    """A tier's config model is its storage only: retention and promotion live in ``TierPolicy``."""
    import tierstore.config  # noqa: F401  (registers every tier type)
    from tierstore.tiers import TierConfig, tier_types
    from tierstore.tiers.registry import config_model

    models = [TierConfig, *(config_model(name) for name in tier_types())]
    declared = {m.__name__: sorted(POLICY_FIELDS & set(m.model_fields)) for m in models if m}
    assert {name: found for name, found in declared.items() if found} == {}


def test_nothing_in_tiers_declares_or_reads_a_policy_field() -> None:
    """``tierstore/tiers/`` knows nothing of retention or promotion: no field, attribute, keyword or
    key of that name."""
    offenders = []
    for name, tree in modules():
        if not name.startswith("tierstore.tiers"):
            continue
        for node in ast.walk(tree):
            found = (
                (isinstance(node, ast.Attribute) and node.attr)
                or (isinstance(node, ast.AnnAssign) and ast.unparse(node.target))
                or (isinstance(node, ast.keyword) and node.arg)
                or (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value)
            )
            if found in POLICY_FIELDS:
                offenders.append(f"{name}:{getattr(node, 'lineno', '?')} {found}")
    assert offenders == [], offenders


TOP_LEVEL_LIMIT = 15


def test_the_top_level_holds_the_vocabulary_only() -> None:
    """Plumbing lives in ``_platform/``, commands in ``cli/``: at most 15 modules at the top."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= TOP_LEVEL_LIMIT, top


def test_one_fork_hook_in_the_package() -> None:
    """Every per-process part joins the runtime's one hook (``_platform/runtime.py``)."""
    hooks = [
        path.relative_to(PACKAGE.parent).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        for _ in range(path.read_text().count("register_at_fork("))
    ]
    assert hooks == ["tierstore/_platform/runtime.py"]


_CONTAINERS = {"dict", "set", "list", "defaultdict", "OrderedDict", "WeakSet", "WeakValueDictionary"}
FILLED_AT_IMPORT = {"tierstore.tiers.registry._TYPES"}
"""Module-level containers filled while the package is imported: the same in every process."""


def test_every_registry_is_one_value_per_process() -> None:
    """A module-level container filled at run time (a registry) is a ``ProcessLocal``: a forked
    child starts with its own, never its parent's commits, groups or buffers. The runtime and the
    fork hook themselves (``_platform/``) keep the process's bookkeeping."""
    found = []
    for name, tree in modules():
        if name.startswith("tierstore._platform"):
            continue
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            empty_literal = isinstance(value, ast.Dict | ast.List | ast.Set) and not ast.unparse(value)[1:-1]
            made = isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in _CONTAINERS
            if empty_literal or made:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target  # type: ignore[union-attr]
                found.append(f"{name}.{ast.unparse(target)}")
    assert sorted(set(found) - FILLED_AT_IMPORT) == []
