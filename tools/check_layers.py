"""The package's house rules, read from its source: floors, cycles, private names, module size.

    python tools/check_layers.py [--graph]

`dspark/` is built in floors (DESIGN.md §2): each subpackage may import from its own floor and the ones below it,
never from above. This script parses every module (function-local imports included, since they hide cycles just as
well), maps each import to the module it reaches, and fails on

- an import that runs back up (a module importing from a higher floor),
- an import cycle among modules (Tarjan's strongly connected components),
- a private name (`_x`) imported from another module,
- a module longer than `MAX_LINES`.

It also counts the floors the rooms (subpackages, and the plain root modules as one room) actually stand on: the
longest chain of rooms importing rooms, which must stay within `MAX_FLOORS`. The package face
(`dspark/__init__.py`) and the two `python -m` faces (`dspark/serve.py`, `dspark/bench.py`) sit above everything:
they only re-export. Standard library only, so CI can run it before anything is installed.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dspark"
MAX_LINES = 450
MAX_FLOORS = 10
# floor of each top-level unit of the package, lowest first (plain root modules are floor 0)
FLOORS = {"sample": 1, "model": 2, "cache": 3, "kernels": 4, "spec": 5, "runtime": 6, "engine": 7,
          "distributed": 8, "entrypoints": 9, "tools": 10}
FACES = {"dspark", "dspark.serve", "dspark.bench"}   # re-export only; above every floor
GENERATED = {"dspark._modidx"}                         # nbdev's index of names: no imports


def modules() -> dict[str, Path]:
    "Dotted name -> file, for every module of the package."
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def unit(mod: str) -> str:
    "The room a module lives in: its subpackage, `root` for the plain modules beside the face, `face` for the faces."
    if mod in FACES: return "face"
    parts = mod.split(".")
    return parts[1] if parts[1] in FLOORS else "root"


def floor(mod: str) -> int:
    "The floor a module stands on by the house plan: its subpackage's, or 0 for a plain root module."
    if mod in FACES: return 99
    parts = mod.split(".")
    return FLOORS.get(parts[1], 0) if len(parts) > 2 or parts[1] in FLOORS else 0


def imports(mod: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    "`(target module, imported name or '', line)` for every import of package modules in `mod`."
    tree, out = ast.parse(path.read_text(encoding="utf-8")), []
    is_pkg = path.name == "__init__.py"
    def owner(dotted: str) -> str | None:
        while dotted and dotted not in mods: dotted = dotted.rpartition(".")[0]
        return dotted or None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (t := owner(a.name)) and t != mod: out.append((t, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else: src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                t = sub if sub in mods else owner(src)
                if t and t != mod: out.append((t, "" if sub in mods else a.name, node.lineno))
    return out


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    "Tarjan's algorithm, iterative: the components with more than one module are the import cycles."
    index, low, on, stack, comps, n = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index: continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = n; n += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work: low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop(); on.discard(x); comp.append(x)
                        if x == v: break
                    if len(comp) > 1: comps.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = n; n += 1; stack.append(w); on.add(w)
                work.append((w, iter(sorted(edges[w]))))
            elif w in on: low[v] = min(low[v], index[w])
    return comps


def depth(edges: dict[str, set[str]]) -> dict[str, int]:
    "The floor each module actually stands on: 1 + the deepest module it imports (an acyclic graph)."
    memo: dict[str, int] = {}
    def d(m: str, seen=()) -> int:
        if m not in memo:
            memo[m] = 1 + max((d(t, seen + (m,)) for t in edges[m] if t not in seen), default=0)
        return memo[m]
    for m in edges: d(m)
    return memo


def check() -> tuple[list[str], dict]:
    mods = {m: p for m, p in modules().items() if m not in GENERATED}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    problems = []
    for m, p in mods.items():
        for t, name, line in imports(m, p, mods):
            if t in GENERATED: continue
            edges[m].add(t)
            where = f"{p.relative_to(ROOT)}:{line}"
            if m not in FACES and floor(t) > floor(m):
                problems.append(f"runs back up: {where} {m} (floor {floor(m)}) imports {t} (floor {floor(t)})")
            if name.startswith("_") and not name.startswith("__"):
                problems.append(f"private name crosses modules: {where} imports {t}.{name}")
    for comp in strongly_connected(edges):
        problems.append("import cycle: " + " <-> ".join(comp))
    lines = {m: p.read_text(encoding="utf-8").count("\n") for m, p in mods.items()}
    for m, n in sorted(lines.items()):
        if n > MAX_LINES: problems.append(f"module too long: {m} {n} lines (limit {MAX_LINES})")
    inner = {m: {t for t in ts if t not in FACES} for m, ts in edges.items() if m not in FACES}
    rooms: dict[str, set[str]] = {unit(m): set() for m in inner}
    for m, ts in inner.items(): rooms[unit(m)] |= {unit(t) for t in ts} - {unit(m)}
    floors = max(depth(rooms).values()) if not strongly_connected(rooms) else None
    if floors is None or floors > MAX_FLOORS: problems.append(f"the rooms stand on {floors} floors (limit {MAX_FLOORS})")
    longest = max(lines, key=lines.get)
    stats = {"modules": len(mods), "floors": floors, "chain": max(depth(inner).values()) if not problems else None,
             "edges": sum(map(len, inner.values())), "longest": f"{longest} ({lines[longest]} lines)"}
    return problems, stats


if __name__ == "__main__":
    problems, stats = check()
    print(f"dspark import graph: {stats['modules']} modules, {stats['edges']} imports; the subpackages stand on "
          f"{stats['floors']} floors (the longest chain of module imports: {stats['chain']} modules); longest module "
          f"{stats['longest']}")
    if "--graph" in sys.argv:
        mods = {m: p for m, p in modules().items() if m not in GENERATED}
        for m, p in mods.items():
            print(m, "->", sorted({t for t, _, _ in imports(m, p, mods) if t not in GENERATED}))
    for line in problems: print("  " + line)
    print("ok: no cycles, no imports that run back up, no private names crossing modules" if not problems
          else f"{len(problems)} problems")
    sys.exit(1 if problems else 0)
