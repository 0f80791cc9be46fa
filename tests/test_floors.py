"""The package's shape: imports go one way (no circle, lazy imports inside functions
included), so every module has a floor and a lower floor never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipes" / "distshard"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Every module's imports of other modules of the package, wherever they stand
    (top level, functions, ``TYPE_CHECKING`` blocks)."""
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in mods]
                targets = subs + ([target] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_lazy_imports():
    graph = imports()
    assert "distshard.plan" in graph["distshard.engine"]
    assert any("distshard.sources" in target for target in graph["distshard"])


# Circles kept for now, each with its reason; the test fails once one is gone, so the list only shrinks.
KNOWN_CIRCLES: list[list[str]] = []


def test_no_import_circles_lazy_imports_included():
    assert circles(imports()) == KNOWN_CIRCLES


PLAN = sorted(name for name in modules() if name == "distshard.plan" or name.startswith("distshard.plan."))


def test_the_pure_arithmetic_imports_nothing_of_torch_or_the_rest():
    assert "distshard.plan.slots" in PLAN and "distshard.plan.carry" in PLAN  # the walk sees the package
    for name in [*PLAN, "distshard.schedule"]:
        text = modules()[name].read_text()
        assert "import torch" not in text and "from torch" not in text, name
        # only the plan's own modules and the errors and digests, which import nothing themselves
        assert imports()[name] <= {"distshard.errors", "distshard.digests", *PLAN}, (name, imports()[name])
    assert not imports()["distshard.errors"] and not imports()["distshard.digests"]


def test_the_plans_modules_do_not_import_the_package_they_make_up():
    """``distshard.plan`` gathers its modules' names; a module of it importing it back would be a circle."""
    for name in PLAN:
        assert "distshard.plan" not in imports()[name], name


def test_the_packing_arithmetic_imports_no_torch_and_only_the_plan():
    text = modules()["distshard.packing"].read_text()
    assert "import torch" not in text and "from torch" not in text
    assert imports()["distshard.packing"] <= {"distshard.errors", *PLAN}


HOOKS = {  # the hooks protocol.py names (see its docstring)
    "__distshard_positional__",
    "__distshard_sequence__",
    "__distshard_units__",
    "distshard_identity",
    "distshard_read",
    "distshard_order",
    "distshard_shuffle_kind",
    "distshard_blocks",
}


def test_only_the_protocol_asks_a_source_for_a_hook():
    """``getattr`` / ``hasattr`` of a source hook by its name happens in protocol.py only."""
    asking = []
    for name, path in modules().items():
        if name == "distshard.protocol":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in HOOKS
            ):
                asking.append((name, node.args[1].value))
    assert asking == []


def test_no_module_imports_another_modules_private_names():
    """A private name (``_x``), or a private module, is its module's own: a module
    that needs it asks for a public one (``graph.is_random_pipe`` instead of torch's
    ``_is_random_datapipe``), ``sources/`` included."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "__main__"):
                found += [f"{name}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
                if any(part.startswith("_") for part in (node.module or "").split(".")):
                    found.append(f"{name}: {node.module}")
    assert found == []


# --- sources/ rooms (issue 32): the floors docs/layout.md and CONTRIBUTING.md describe ---
#: sources/'s rooms, each with the rooms below it that it may import (and BELOW_ROOMS, below them all);
#: sources/pipe.py, sources/sequence.py and sources/__init__.py stand above every room, and no room imports them
ROOMS: dict[str, set[str]] = {
    "transport": set(),
    "formats": {"transport"},
    "reading": {"transport"},
    "stored": {"transport", "formats", "reading"},  # manifest3 < paged < manifest < indexing, pruning; entry_packs
}
#: below every room: how a file source reads, and the byte ranges every fetch ahead asks (pure arithmetic)
BELOW_ROOMS = {"distshard.sources.read_options", "distshard.sources.coalesce"}
SOURCES_OUTSIDE_ROOMS = {
    "distshard.sources",
    "distshard.sources.pipe",
    *BELOW_ROOMS,
    # the pipe's own random-access view: it reads through reading/ the entries stored/ keeps, so above every room
    "distshard.sources.sequence",
}
#: transport's clients: a format names byte spans and parses bytes, it opens files through transport/files.py
CLIENTS = {
    f"distshard.sources.transport.{name}"
    for name in ("clients", "ranged", "remote", "over_http", "s3direct", "s3pool", "s3config", "sigv4", "streamed")
}
#: imports against the floors, each with why it is still there (the list may shrink, never grow)
UPWARD: dict[tuple[str, str], str] = {}


def room_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["distshard", "sources"] and parts[2] in ROOMS else None


def test_every_module_of_sources_sits_in_a_room():
    loose = [n for n in modules() if n.startswith("distshard.sources") and n not in SOURCES_OUTSIDE_ROOMS]
    assert [n for n in loose if room_of(n) is None and n.rsplit(".", 1)[-1] not in ROOMS] == []


def test_the_rooms_import_only_the_rooms_below_them():
    against = []
    for name, targets in imports().items():
        room = room_of(name)
        for target in targets if room else ():
            allowed = ROOMS[room] | {room}
            if target.startswith("distshard.sources") and target not in BELOW_ROOMS:
                if room_of(target) not in allowed and (name, target) not in UPWARD:
                    against.append((name, target))
    assert against == []


def test_what_stands_below_every_room_imports_nothing_of_sources():
    graph = imports()
    assert {name: {t for t in graph[name] if t.startswith("distshard.sources")} for name in BELOW_ROOMS} == {
        name: set() for name in BELOW_ROOMS
    }


def test_the_formats_import_no_remote_client():
    graph = imports()
    assert [(n, t) for n in graph if room_of(n) == "formats" for t in graph[n] if t in CLIENTS] == []


def test_every_upward_import_listed_is_still_there():
    graph = imports()
    assert [pair for pair in UPWARD if pair[1] not in graph[pair[0]]] == []


# --- end of sources/ rooms ---
