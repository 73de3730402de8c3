"""Every tensor the runtime creates names its device: the engine's, or ``"cpu"`` for host buffers.
A factory call without ``device=`` lands on the CPU on a GPU machine, which is right only by
accident; this walks the runtime code (not tests, benchmarks or examples) and names each one."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = [ROOT / "zkit", *sorted((ROOT / "plugins").glob("*/src")), ROOT / "cuda_numba" / "src"]
#: torch functions that allocate a new tensor on a device of their choosing
FACTORIES = {
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
    "eye", "linspace", "logspace", "empty_strided", "as_tensor", "frombuffer",
}
#: creations that are host-side by nature (bytes read from a file or a Python buffer)
HOST_BY_NATURE = {"frombuffer"}


def _offenders() -> list[str]:
    found = []
    for root in RUNTIME:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                base = node.func.value
                if not (isinstance(base, ast.Name) and base.id == "torch" and node.func.attr in FACTORIES):
                    continue
                if node.func.attr in HOST_BY_NATURE or any(k.arg == "device" for k in node.keywords):
                    continue
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{node.func.attr}(...) names no device")
    return found


def test_every_runtime_tensor_factory_names_its_device():
    offenders = _offenders()
    assert not offenders, "\n".join(offenders)
