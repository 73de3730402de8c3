"""The kernel's shape in numbers: lines per package (all lines, and code lines: neither blank, a
comment nor a docstring), import circles, function-local imports,
direct communicator constructions, and imports of plugin distributions from ``zkit/``; and the
plugin contract: imports from one built-in package (``zkit/<package>/`` other than the core) into
another, circles between built-in packages, and imports of a built-in's non-public modules (any
module but a package's ``__init__``, ``zkit.core`` and ``zkit``'s top-level modules) by another
built-in or by an installed plugin.

    python tools/kernel_report.py            # table on stdout
    python tools/kernel_report.py --json     # the same as JSON

Only module-level imports make an import edge; an import inside a function is counted apart,
since such imports are how an import circle is usually hidden.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_PACKAGES = ("zkit_pipeline", "zkit_offload", "zkit_onebit", "zkit_sparse", "zkit_deepspeed",
                   "zkit_cuda_numba", "deepspeed")

#: import packages shipped by one distribution: imports between them are internal
SAME_DISTRIBUTION = {"zkit_deepspeed": "deepspeed"}


def module_name(path: Path, src_root: Path) -> str:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_lines(path: Path) -> tuple[int, int]:
    """``(all lines, code lines)``: code lines are neither blank, a comment nor a docstring (the
    hook specs' docstrings are the plugin author's manual: the two figures tell code from manual)."""
    text = path.read_text()
    lines = text.splitlines()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    code = sum(1 for number, line in enumerate(lines, 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)
    return len(lines), code


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(tree: ast.Module, module: str, is_package: bool, modules: dict | None = None):
    """Yield (target, is_local, is_type_checking) for every import in the module."""
    type_checking_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                type_checking_nodes.add(id(child))
    function_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                if child is not node:
                    function_nodes.add(id(child))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node, module, is_package)
            # ``from pkg import submodule`` depends on the submodule; only a name defined in the
            # package's ``__init__`` makes the package itself a dependency
            targets = [f"{base}.{alias.name}" for alias in node.names]
            if modules is None or any(t not in modules for t in targets):
                targets.append(base)
        for target in targets:
            yield target, id(node) in function_nodes, id(node) in type_checking_nodes


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

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
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def report(package_dir: Path, src_root: Path) -> dict:
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        modules[module_name(path, src_root)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    full_graph: dict[str, set[str]] = {m: set() for m in modules}
    local_imports: list[str] = []
    plugin_imports: list[str] = []
    constructions: list[str] = []
    core_outward: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        seen_local: set[int] = set()
        for target, is_local, is_typing in imports_of(tree, module, is_package, modules):
            top = target.split(".")[0]
            if top in PLUGIN_PACKAGES and SAME_DISTRIBUTION.get(top, top) != SAME_DISTRIBUTION.get(
                    package_dir.name, package_dir.name):
                plugin_imports.append(f"{path.relative_to(ROOT)}: {target}")
            if target in modules and target != module:
                core = f"{package_dir.name}.core"
                if module.startswith(core) and not target.startswith(core) and target != package_dir.name \
                        and not is_typing:
                    core_outward.append(f"{path.relative_to(ROOT)}: {target}")
                if not is_typing:
                    full_graph[module].add(target)
                if is_local:
                    seen_local.add(hash((target, module)))
                    local_imports.append(f"{path.relative_to(ROOT)}: {target}")
                elif not is_typing:
                    graph[module].add(target)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name == "TorchCommunicator":
                    constructions.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    packages: dict[str, int] = {}
    code: dict[str, int] = {}
    for module, path in modules.items():
        parts = module.split(".")
        key = ".".join(parts[:2]) if path.name == "__init__.py" or len(parts) > 2 else parts[0]
        if path.name == "__init__.py" and len(parts) == 1:
            key = parts[0]
        lines, code_lines = source_lines(path)
        packages[key] = packages.get(key, 0) + lines
        code[key] = code.get(key, 0) + code_lines
    return {
        "lines": sum(packages.values()),
        "code_lines": sum(code.values()),
        "packages": dict(sorted(packages.items())),
        "package_code_lines": dict(sorted(code.items())),
        "circles": strongly_connected(graph),
        "circles_with_local_imports": strongly_connected(full_graph),
        "function_local_imports": sorted(set(local_imports)),
        "communicator_constructions": constructions,
        "plugin_imports": sorted(set(plugin_imports)),
        "core_imports_outside_core": sorted(set(core_outward)),
    }


# -- the plugin contract: what hooks hand plugins, and what the kernel knows of distributions ----

#: names under which code outside the core holds an engine (a hook argument, a plugin's field)
ENGINE_HOLDERS = ("engine", "eng", "_engine")
#: words in a kernel string that name what a distribution or a built-in plugin provides
CATALOGUE_WORDS = ("offload_optimizer", "offload_param", "offload section")


def hooks_taking_engine(hookspecs: Path) -> list[str]:
    """The hooks with an argument annotated ``Engine`` (the whole engine handed to a plugin)."""
    tree = ast.parse(hookspecs.read_text())
    return sorted(node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                  and any(arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") == "Engine"
                          for arg in node.args.args + node.args.kwonlyargs))


def engine_attributes_outside_core(sources: list[Path]) -> dict[str, list[str]]:
    """``{attribute: [files]}``: ``engine.X`` (or ``self.engine.X``) read by code outside ``zkit/core``."""
    found: dict[str, set[str]] = {}
    for source in sources:
        for path in sorted(source.rglob("*.py")):
            if path.is_relative_to(ROOT / "zkit" / "core"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                holder = node.value
                name = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(
                    holder, ast.Attribute) else None
                if name in ENGINE_HOLDERS:
                    found.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    return {attr: sorted(files) for attr, files in sorted(found.items())}


def kernel_catalogue(core: Path, builtin_plugins: list[str]) -> list[str]:
    """Strings in the kernel's code (docstrings left out) that name a plugin distribution
    (``zkit-offload``), a built-in plugin outside the list that loads them, or what one provides
    (``offload``): each is something the kernel knows about who provides what."""
    found = []
    for path in sorted(core.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        skip: set[int] = set()
        for node in ast.walk(tree):  # the loading list itself is where built-ins are named
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BUILTIN_PLUGINS" for t in node.targets):
                skip.update(id(child) for child in ast.walk(node))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docstrings \
                    or id(node) in skip:
                continue
            text = node.value
            if re.search(r"\bzkit-[a-z]", text) or any(name in text for name in builtin_plugins) \
                    or any(word in text for word in CATALOGUE_WORDS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]!r}")
    return found


def contract_report() -> dict:
    tree = ast.parse((ROOT / "zkit" / "core" / "plugin_manager.py").read_text())
    builtin = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and re.fullmatch(r"zkit\.[a-z_]+", n.value) and not n.value.startswith("zkit.core")
               and "." not in n.value[5:]]
    sources = [ROOT / "zkit", *sorted((ROOT / "plugins").glob("*/src")), ROOT / "cuda_numba" / "src"]
    hookspecs = ROOT / "zkit" / "core" / "hookspecs.py"
    return {
        "hooks": sum(1 for n in ast.parse(hookspecs.read_text()).body
                     if isinstance(n, ast.FunctionDef) and n.name.startswith("zkit_")),
        "hooks_taking_engine": hooks_taking_engine(hookspecs),
        "engine_attributes_outside_core": engine_attributes_outside_core(sources),
        "kernel_catalogue": kernel_catalogue(ROOT / "zkit" / "core", builtin),
    }


def print_contract(contract: dict, verbose: bool) -> None:
    print(f"\nplugin contract: {len(contract['hooks_taking_engine'])} of {contract['hooks']} hooks take the whole "
          f"Engine; {len(contract['engine_attributes_outside_core'])} engine attribute(s) read outside zkit/core; "
          f"{len(contract['kernel_catalogue'])} kernel string(s) naming a distribution, a built-in plugin or "
          f"what one provides")
    if verbose:
        print("  hooks taking the engine:", " ".join(contract["hooks_taking_engine"]))
        print("  engine attributes:", " ".join(contract["engine_attributes_outside_core"]))
        for line in contract["kernel_catalogue"]:
            print("  ", line)


def _trees() -> dict[str, tuple[Path, Path]]:
    trees = {"zkit": (ROOT / "zkit", ROOT)}
    for plugin in sorted((ROOT / "plugins").iterdir()):
        for package in sorted((plugin / "src").glob("*")):
            if package.is_dir() and (package / "__init__.py").exists():
                trees[package.name] = (package, plugin / "src")
    for package in sorted((ROOT / "cuda_numba" / "src").glob("*")):
        if package.is_dir() and (package / "__init__.py").exists():
            trees[package.name] = (package, ROOT / "cuda_numba" / "src")
    return trees


def import_contract(trees: dict[str, tuple[Path, Path]] | None = None) -> dict:
    """Who imports which built-in, and through which door.

    A built-in package's public names are those its ``__init__`` exports; ``zkit.core`` is public
    whole, and so are ``zkit``'s top-level modules (``zkit.testing``, ``zkit.cli``). Every import
    counts, function-local and ``TYPE_CHECKING`` ones too: a circle hidden inside a function is
    still a circle, and a type read from a private module still ties the importer to it."""
    trees = trees or _trees()
    zkit_dir, zkit_src = trees["zkit"]
    modules = {module_name(path, zkit_src): path for path in sorted(zkit_dir.rglob("*.py"))}
    builtins = sorted(d.name for d in zkit_dir.iterdir()
                      if d.is_dir() and d.name != "core" and (d / "__init__.py").exists())

    def builtin_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == "zkit" and parts[1] in builtins else None

    def public(target: str) -> bool:
        return builtin_of(target) is None or modules[target].name == "__init__.py"

    builtin_imports: set[str] = set()
    builtin_private: set[str] = set()
    package_graph: dict[str, set[str]] = {b: set() for b in builtins}
    plugin_private: dict[str, set[str]] = {}
    for name, (package_dir, src_root) in trees.items():
        for path in sorted(package_dir.rglob("*.py")):
            module = module_name(path, src_root)
            tree = ast.parse(path.read_text())
            for target, _local, _typing in imports_of(tree, module, path.name == "__init__.py", modules):
                if target not in modules:
                    continue
                line = f"{path.relative_to(ROOT)}: {target}"
                if name != "zkit":
                    if not public(target):
                        plugin_private.setdefault(name, set()).add(line)
                    continue
                source, into = builtin_of(module), builtin_of(target)
                if source is None or into is None or source == into:
                    continue
                builtin_imports.add(line)
                package_graph[source].add(into)
                if not public(target):
                    builtin_private.add(line)
    return {
        "builtin_packages": builtins,
        "builtin_imports": sorted(builtin_imports),
        "builtin_private_imports": sorted(builtin_private),
        "builtin_dependencies": {b: sorted(d) for b, d in package_graph.items() if d},
        "package_circles": strongly_connected(package_graph),
        "plugin_private_imports": {name: sorted(lines) for name, lines in sorted(plugin_private.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="list every local import and construction")
    args = parser.parse_args()
    trees = _trees()
    result = {name: report(path, src) for name, (path, src) in trees.items()}
    contract = contract_report()
    imports = import_contract(trees)
    if args.json:
        print(json.dumps({**result, "contract": contract, "import_contract": imports}, indent=1))
        return
    total = sum(r["lines"] for r in result.values())
    total_code = sum(r["code_lines"] for r in result.values())
    print(f"{'package':<34} {'lines':>6} {'code':>6}")
    for name, r in result.items():
        for pkg, lines in r["packages"].items():
            print(f"{pkg:<34} {lines:>6} {r['package_code_lines'][pkg]:>6}")
        print(f"{'= ' + name:<34} {r['lines']:>6} {r['code_lines']:>6}")
    print(f"{'= all source':<34} {total:>6} {total_code:>6}   zkit/ is {100 * result['zkit']['lines'] / total:.0f}%")
    for name, r in result.items():
        circles = r["circles"]
        full = r["circles_with_local_imports"]
        print(f"\n{name}: {len(circles)} import circle(s) {[len(c) for c in circles]} "
              f"({len(full)} {[len(c) for c in full]} counting function-local imports), "
              f"{len(r['function_local_imports'])} function-local import(s) "
              f"of its own modules, {len(r['communicator_constructions'])} direct TorchCommunicator "
              f"construction(s), {len(r['plugin_imports'])} import(s) of a plugin distribution")
        if name == "zkit":
            print(f"zkit.core: {len(r['core_imports_outside_core'])} import(s) of zkit modules outside the core")
        if args.verbose:
            for c in full:
                print("  circle:", " ".join(c))
            for line in (r["function_local_imports"] + r["communicator_constructions"] + r["plugin_imports"]
                         + r["core_imports_outside_core"]):
                print("  ", line)
    print_contract(contract, args.verbose)
    c = imports
    private = c["plugin_private_imports"]
    print(f"\nbuilt-in packages: {len(c['builtin_imports'])} import(s) from one into another "
          f"({len(c['builtin_private_imports'])} of a non-public module), "
          f"{len(c['package_circles'])} circle(s) between packages {c['package_circles']}")
    print(f"installed plugins: {sum(len(v) for v in private.values())} import(s) of built-ins' non-public modules "
          f"({', '.join(f'{name} {len(lines)}' for name, lines in private.items()) or 'none'})")
    if args.verbose:
        for source, targets in c["builtin_dependencies"].items():
            print(f"  {source} -> {' '.join(targets)}")
        for line in c["builtin_imports"] + [line for lines in private.values() for line in lines]:
            print("  ", line)



if __name__ == "__main__":
    main()
