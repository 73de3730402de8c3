"""List the ``deepspeed`` names that code imports or reaches: the candidates of the drop-in's coverage
inventory (``plugins/zkit-deepspeed/src/zkit_deepspeed/coverage.py``).

    python tools/scan_deepspeed_names.py LABEL=PATH [LABEL=PATH ...] [--json OUT]

A PATH is a Python file, a directory (every ``*.py`` under it), or ``git:REPO_DIR[:SUBDIR]`` for a
bare git repository (its HEAD is read with ``git ls-tree`` / ``git cat-file``, no work tree
needed). Found, for each file, with :mod:`ast`:

- ``import deepspeed.a.b`` and ``from deepspeed.a import b`` give ``deepspeed.a.b``;
- ``deepspeed.a.b.c`` (an attribute chain on a name bound to ``deepspeed`` or to an imported
  ``deepspeed`` module) gives ``deepspeed.a.b.c``;
- a string constant ``"deepspeed.a.b"`` (what ``importlib.util.find_spec`` probes take).

Prints one name a line with the labels of the sources that use it. The scanned sources stay
outside this repository; the inventory records the labels.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterator

DOTTED = re.compile(r"^deepspeed(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def names_in(source: str) -> set[str]:
    """The ``deepspeed`` names one Python file uses (empty when it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    bound: dict[str, str] = {}  # local name -> the deepspeed name it stands for
    found: set[str] = set()
    inner: set[int] = set()  # attribute nodes that are part of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "deepspeed" or a.name.startswith("deepspeed."):
                    found.add(a.name)
                    bound[a.asname or "deepspeed"] = a.name if a.asname else "deepspeed"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "deepspeed" or node.module.startswith("deepspeed.")):
            for a in node.names:
                full = node.module if a.name == "*" else f"{node.module}.{a.name}"
                found.add(full)
                if a.name != "*":
                    bound[a.asname or a.name] = full
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.match(node.value):
            found.add(node.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in bound:
                found.add(".".join([bound[chain[0]], *chain[1:]]))
    return found


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def sources(path: str) -> Iterator[tuple[str, str]]:
    """(file name, text) of every Python file under ``path``."""
    if path.startswith("git:"):
        repo, _, sub = path[4:].partition(":")
        listing = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "HEAD", "--", sub or "."],
                                 capture_output=True, text=True, check=True).stdout
        for line in listing.splitlines():
            meta, name = line.split("\t", 1)
            if name.endswith(".py") and meta.split()[1] == "blob":
                text = subprocess.run(["git", "-C", repo, "cat-file", "blob", meta.split()[2]],
                                      capture_output=True, check=True).stdout
                yield name, text.decode("utf-8", "replace")
        return
    p = Path(path)
    for f in ([p] if p.is_file() else sorted(p.rglob("*.py"))):
        yield str(f), f.read_text(encoding="utf-8", errors="replace")


def scan(labelled: list[tuple[str, str]]) -> dict[str, list[str]]:
    """name -> sorted labels of the sources using it."""
    users: dict[str, set[str]] = defaultdict(set)
    for label, path in labelled:
        for _, text in sources(path):
            if "deepspeed" not in text:
                continue
            for name in names_in(text):
                users[name].add(label)
    return {n: sorted(users[n]) for n in sorted(users)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--json", help="write {name: [labels]} here as well")
    args = parser.parse_args(argv)
    labelled = []
    for item in args.sources:
        label, sep, path = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: give LABEL=PATH")
        labelled.append((label, path))
    found = scan(labelled)
    for name, labels in found.items():
        print(f"{name}\t{','.join(labels)}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
