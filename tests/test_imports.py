"""Imports follow the layers: every module in a row of docs/architecture.md's layer table, no import
up or sideways, no loop between modules; foundations and workers never pull in the client library."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.mark.parametrize("module", ["shmserve.arena", "shmserve.layout", "shmserve.rings", "shmserve.lanes",
                                    "shmserve.protocol", "workers.main"])
def test_a_foundation_module_does_not_import_the_client(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in ('shmserve.client', 'asyncio', 'uvloop') if m in sys.modules)\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} imported {out}"


def test_the_public_api_is_still_one_import_away():
    import shmserve

    assert shmserve.Client.__module__ == "shmserve.client"
    assert shmserve.ErrorCode.TIMEOUT.wire == "timeout"
    assert {"AsyncClient", "Client", "ConnectionClosed", "ErrorCode", "ShmserveError"} <= set(dir(shmserve))
    with pytest.raises(AttributeError):
        shmserve.NotAThing  # noqa: B018


# -- the layer table of docs/architecture.md, held ------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("shmserve", "workers")  # the import names whose modules the table places
TABLE = "the layer table of docs/architecture.md (## Layers)"


@dataclass
class Layers:
    """The layer table: each layer's entries and the layers it rests on (directly)."""

    entries: dict[str, str]  # entry (a module name, or a package name ending in '.') -> its layer
    rests_on: dict[str, tuple[str, ...]]  # layer -> the layers directly under it

    def below(self, layer: str) -> set[str]:
        """Every layer ``layer`` rests on, all the way down."""
        seen, todo = set(), list(self.rests_on[layer])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.rests_on[name])
        return seen

    def entry_of(self, module: str) -> str | None:
        """The table's entry that places ``module`` (a package's entry places everything in it)."""
        if module in self.entries:
            return module
        parts = module.split(".")
        for n in range(len(parts), 0, -1):
            package = ".".join(parts[:n]) + "."
            if package in self.entries:
                return package
        return None


def entry_module(entry: str) -> str:
    """A table entry (``layout.py``, ``frontend/unix.py``, ``_atomics.c``, ``doctor/``, ``workers/``,
    ``__init__.py``) as a module name (``shmserve.layout``) or a package's (``shmserve.doctor.``)."""
    if entry == "__init__.py":
        return "shmserve"
    package = entry.endswith("/")
    name = entry.rstrip("/").removesuffix(".py").removesuffix(".c").removesuffix("/__init__").replace("/", ".")
    if name.split(".")[0] not in PACKAGES:
        name = "shmserve." + name
    return name + "." if package else name


def read_layers(text: str) -> Layers:
    """The table under '## Layers' of ``text`` (columns: layer, rests on, modules, what they are)."""
    section = ("\n" + text).split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    entries, rests_on = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("layer", "---") or len(cells) < 3:
            continue
        layer = cells[0]
        rests_on[layer] = tuple(n.strip() for n in cells[1].split(",") if n.strip() not in ("", "—"))
        for entry in re.findall(r"`([^`]+)`", cells[2]):
            module = entry_module(entry)
            assert module not in entries, f"{entry} is in two rows of {TABLE}"
            entries[module] = layer
    for layer, under in rests_on.items():
        for name in under:
            assert name in rests_on, f"layer {layer!r} rests on {name!r}, which is not a layer of {TABLE}"
    return Layers(entries, rests_on)


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the packages under ``root``: name -> file (a C extension: its source)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if "__pycache__" in path.parts or path.suffix not in (".py", ".c"):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (functions included)."""
    if path.suffix == ".c":
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def longest_known(dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(longest_known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(longest_known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known
                          else longest_known(base))
    return {m for m in found if m is not None and m != name}


def layer_problems(root: Path, table_text: str) -> list[str]:
    """What breaks the layer table under ``root``: modules it does not place, imports that go up
    or sideways, and loops between its entries."""
    layers = read_layers(table_text)
    known = project_modules(root)
    problems, graph = [], {}
    for name in sorted(known):
        if layers.entry_of(name) is None:
            problems.append(f"{name} ({known[name].relative_to(root)}) has no layer: add it to a row of {TABLE}")
    for name in sorted(known):
        entry = layers.entry_of(name)
        if entry is None:
            continue
        layer = layers.entries[entry]
        allowed = {layer} | layers.below(layer)
        for target in sorted(imports_of(name, known[name], known)):
            target_entry = layers.entry_of(target)
            if target_entry is None:
                continue
            if target_entry != entry:
                graph.setdefault(entry, set()).add(target_entry)
            target_layer = layers.entries[target_entry]
            if target_layer not in allowed:
                problems.append(f"{name} ({layer}) imports {target} ({target_layer}): {layer!r} does not rest on "
                                f"{target_layer!r} in {TABLE}")
    problems += [f"these entries of {TABLE} import each other around a loop: {' -> '.join(loop)}"
                 for loop in loops(graph)]
    return problems


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop through each strongly connected set of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(path_around(graph, sorted(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def path_around(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A loop from ``members[0]`` back to itself inside ``members`` (breadth first)."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return paths[node] + [start]
            if nxt in inside and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    return members


def test_no_import_goes_up_the_layer_table_and_every_module_has_a_layer():
    problems = layer_problems(ROOT, ARCHITECTURE.read_text())
    assert not problems, "\n".join(problems)


def test_the_layer_check_finds_what_it_is_for(tmp_path):
    """The check itself, on a small tree: an upward import, a module no row names, a loop inside a
    layer, a relative import and one inside a function are each found."""
    table = textwrap.dedent("""\
        ## Layers

        | layer | rests on | modules | what they are |
        | --- | --- | --- | --- |
        | low | — | `__init__.py`, `base.py`, `_fast.c` | a |
        | high | low | `top.py`, `tools/`, `other.py` | b |
        | side | low | `workers/` | c |

        ## Next
        """)
    files = {"shmserve/__init__.py": "", "shmserve/_fast.c": "",
             "shmserve/base.py": "def f():\n    from shmserve import top\n",  # up, inside a function
             "shmserve/top.py": "from shmserve import _fast\nimport shmserve.other\n",
             "shmserve/other.py": "from .top import x\n",  # a loop with top, relative
             "shmserve/tools/__init__.py": "from . import deep\n", "shmserve/tools/deep.py": "import workers.w\n",
             "shmserve/stray.py": "", "workers/__init__.py": "", "workers/w.py": "from shmserve.base import f\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    problems = layer_problems(tmp_path, table)
    assert any(p.startswith("shmserve.stray (shmserve/stray.py) has no layer") and "docs/architecture.md" in p
               for p in problems), problems
    assert any(p.startswith("shmserve.base (low) imports shmserve.top (high)") for p in problems), problems
    assert any(p.startswith("shmserve.tools.deep (high) imports workers.w (side)") for p in problems), problems
    assert any("loop" in p and "shmserve.other" in p and "shmserve.top" in p for p in problems), problems
    assert len(problems) == 4, problems  # workers.w -> base is down; tools -> tools.deep is inside one entry
