#!/usr/bin/env python3
"""The floors of kvq/ (shared/DESIGN.md, "keep the house layered") and a check of its imports.

A module imports only from its own floor or below, lazily (inside a function) or not, and no
group of modules imports itself round in a circle.  The check reads every ``.py`` file under
a package root with :mod:`ast`: each ``import kvq...`` / ``from kvq... import`` / relative
import, wherever it stands, is an edge from the module to the deepest kvq module it names.

    python scripts/layering.py            # the floors, then every upward import and circle (exit 1 if any)
    python scripts/layering.py --markdown # the floors as a Markdown table (docs/architecture.md)

tests/test_layering.py runs :func:`violations` on kvq/ and on a planted tree.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

#: Floors, lowest first: (name, the top-level parts of kvq on it, what lives there).
FLOORS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("formats", ("formats", "units", "text", "data"), "KV formats: bytes, layouts, reference quantizers"),
    ("cache", ("cache",), "plans, pools, blocks and their manager, windows, static scales, tensor-free geometry"),
    ("attention, models", ("attention", "models"), "kernels and their backends; model code, loading, identity"),
    ("engine", ("engine",), "config and its flags, scheduler, runner, CUDA graphs, the step loop"),
    ("executors, connectors", ("parallel", "connectors"),
     "tensor parallelism (the executor, the process group, the ranks above 0); KV connectors (the CPU prefix tier, "
     "swap's copies, a decode engine's prefill peer, a prefill engine's export)"),
    ("applications", ("eval", "calibration", "transfer", "server", "environment"),
     "kvq eval, calibrate and tune, P->D transfer, the OpenAI server, kvq env"),
    ("entry points", ("cli", "__main__", "__init__"), "the command line and the package's public names"),
)


def floor_of(module: str) -> int:
    """Floor index of a dotted module name under kvq (``kvq`` itself is its ``__init__``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, (_, tops, _) in enumerate(FLOORS):
        if top in tops:
            return i
    raise KeyError(f"{module}: its part {top!r} is on no floor; add it to FLOORS in scripts/layering.py")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package directory ``root``."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _target(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported kvq module: first line}, lazy imports included."""
    mods = modules(root)
    pkg = root.name
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                names = [f"{name}.{a.name}" for a in node.names] or [name]
            for name in names:
                if name == pkg or name.startswith(pkg + "."):
                    t = _target(name, mods)
                    if t is not None and t != mod:
                        graph[mod].setdefault(t, node.lineno)
    return {m: dict(graph.get(m, {})) for m in mods}


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, {}))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return sorted(out)


def violations(root: Path) -> tuple[list[tuple[str, str, int]], list[list[str]]]:
    """(upward imports as (module, imported, line), circles as sorted module lists) under ``root``."""
    graph = import_graph(root)
    up = sorted((m, t, line) for m, es in graph.items() for t, line in es.items() if floor_of(t) > floor_of(m))
    return up, _circles(graph)


def markdown() -> str:
    rows = ["| floor | parts of `kvq/` | what lives there |", "| --- | --- | --- |"]
    for i, (name, tops, what) in reversed(list(enumerate(FLOORS))):
        rows.append(f"| {i} {name} | {', '.join(f'`{t}`' for t in tops)} | {what} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "kvq"))
    p.add_argument("--markdown", action="store_true", help="print the floors as a Markdown table and stop")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    up, circles = violations(Path(args.root))
    for m, t, line in up:
        print(f"upward: {m}:{line} imports {t} (floor {floor_of(m)} -> {floor_of(t)})")
    for c in circles:
        print("circle: " + " -> ".join(c))
    print(f"{len(up)} upward imports, {len(circles)} circles")
    return 1 if up or circles else 0


if __name__ == "__main__":
    sys.exit(main())
