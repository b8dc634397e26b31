"""Counts the structural faults the house is built to avoid, over the product code.

    python tests/structure.py        # prints each count and the places behind it

Product code is streamer/, producers/ and monitor/. Counted: import cycles between
modules, upward imports (producers/ or monitor/ importing streamer/), underscore names
imported from another module, argparse imported outside the CLI room (streamer/cli/), aiokafka
imported in streamer/ outside its Kafka package (streamer/kafka/),
modules reading the environment, hand-written __repr__ in strategies, modules calling
torch.save, and pickle imports.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streamer", "producers", "monitor")
CLI_ROOM = "streamer.cli"
KAFKA_ROOM = "streamer.kafka"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Imports:
    targets: set[str] = field(default_factory=set)  # product modules imported, at any depth of the file
    private: list[str] = field(default_factory=list)  # "from x import _name"
    names: set[str] = field(default_factory=set)  # every imported top-level module name


def imports_of(module: str, path: Path, known: dict[str, Path]) -> Imports:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = Imports()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.names.add(alias.name)
                if alias.name in known:
                    found.targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            found.names.add(source)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in known:  # a submodule
                    found.targets.add(full)
                elif source in known:
                    found.targets.add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.private.append(f"{module}: from {source} import {alias.name}")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def check() -> dict[str, list[str]]:
    known = product_modules()
    graph: dict[str, set[str]] = {}
    faults: dict[str, list[str]] = {key: [] for key in (
        "cycles", "upward", "private", "argparse", "aiokafka", "environment", "strategy_repr", "torch_save",
        "pickle")}
    for module, path in known.items():
        found = imports_of(module, path, known)
        # a package's own __init__ is not an edge from its submodules (importing a.b runs a/__init__)
        graph[module] = {t for t in found.targets if t != module and t not in _parents(module)}
        faults["private"] += found.private
        top = module.split(".")[0]
        if top in ("producers", "monitor"):
            faults["upward"] += [f"{module} -> {t}" for t in sorted(found.targets) if t.split(".")[0] == "streamer"]
        if "argparse" in found.names and not (module == CLI_ROOM or module.startswith(CLI_ROOM + ".")):
            faults["argparse"].append(module)
        if top == "streamer" and any(name.split(".")[0] == "aiokafka" for name in found.names) \
                and not module.startswith(KAFKA_ROOM + "."):
            faults["aiokafka"].append(module)
        if "pickle" in found.names or "cPickle" in found.names or "dill" in found.names:
            faults["pickle"].append(module)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        if _reads_environment(tree):
            faults["environment"].append(module)
        if module.startswith("streamer.strategies") and any(
                isinstance(n, ast.FunctionDef) and n.name == "__repr__" for n in ast.walk(tree)):
            faults["strategy_repr"].append(module)
        if any(isinstance(n, ast.Call) and _dotted(n.func) in ("torch.save",) for n in ast.walk(tree)):
            faults["torch_save"].append(module)
    faults["cycles"] = [" <-> ".join(c) for c in _cycles(graph)]
    return faults


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        name = _dotted(node) if isinstance(node, ast.Attribute) else ""
        if name in ("os.environ", "os.getenv", "os.environb"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            return True
    return False


if __name__ == "__main__":
    for key, items in check().items():
        print(f"{key}: {len(items)}")
        for item in items:
            print(f"    {item}")
