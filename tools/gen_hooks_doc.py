"""Write docs/hooks.md from the docstrings of zkit/core/hookspecs.py: python tools/gen_hooks_doc.py"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

from zkit.core import hookspecs

REGISTRATION = [
    "zkit_register_partitioners", "zkit_register_communicators", "zkit_register_optimizers",
    "zkit_register_schedulers", "zkit_register_allocators", "zkit_register_attention",
    "zkit_register_checkpoint_formats", "zkit_register_providers", "zkit_config_sections",
]


def hook_names() -> list[str]:
    return [n for n, f in vars(hookspecs).items() if n.startswith("zkit_") and callable(f)]


def render() -> str:
    lines = [
        "# Hook reference",
        "",
        "Every hook zkit calls, generated from the docstrings in `zkit/core/hookspecs.py` by",
        "`python tools/gen_hooks_doc.py` (a test fails when a hook is missing here). A plugin implements",
        "hooks as plain functions marked `@zkit.hookimpl` in a module or class registered through the",
        "entry-point group `zkit`; see [writing-plugins.md](writing-plugins.md).",
        "",
    ]
    lifecycle = [n for n in hook_names() if n not in REGISTRATION]
    for title, names in (("Registration hooks", REGISTRATION), ("Lifecycle hooks", lifecycle)):
        lines += [f"## {title}", ""]
        for name in names:
            fn = getattr(hookspecs, name)
            opts = getattr(fn, f"{hookspecs.PROJECT}_spec", {}) or {}
            sig = str(inspect.signature(fn)).replace("'", "")
            rule = " — *firstresult: the first non-None answer wins*" if opts.get("firstresult") else ""
            lines += [f"### `{name}{sig}`{rule}", "", inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
    out.write_text(render())
    sys.stdout.write(f"wrote {out}\n")
