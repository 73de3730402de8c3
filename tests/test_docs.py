"""The documentation keeps up with the code."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_hooks_doc  # noqa: E402


def test_every_hook_is_documented_and_current():
    text = (ROOT / "docs" / "hooks.md").read_text()
    for name in gen_hooks_doc.hook_names():
        assert f"### `{name}(" in text, f"{name} is missing from docs/hooks.md"
    assert text == gen_hooks_doc.render(), "docs/hooks.md is stale: run python tools/gen_hooks_doc.py"


def test_every_plugin_has_a_readme_with_install_and_use():
    for dist in ["plugins/zkit-offload", "plugins/zkit-onebit", "plugins/zkit-pipeline", "plugins/zkit-sparse", "plugins/zkit-sequence", "cuda_numba"]:
        readme = (ROOT / dist / "README.md").read_text()
        assert "pip install" in readme, dist


def test_the_index_names_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT / "docs").as_posix()
        if name != "index.md":
            assert f"]({name})" in index, f"docs/index.md does not list {name}"


def _readme_layout() -> str:
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    return layout[layout.index("```"):layout.index("```", layout.index("```") + 3)]


def test_the_readme_is_a_front_page():
    """At most 1000 words, opening with the two set-up commands."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 1000
    assert readme.splitlines()[1].startswith("make demo") and readme.splitlines()[2].startswith("make test")


def test_the_readme_layout_names_every_folder_and_module_of_zkit():
    layout = _readme_layout()
    missing = [path.name for path in sorted((ROOT / "zkit").iterdir())
               if (path.is_dir() and (path / "__init__.py").exists() and f"{path.name}/" not in layout)
               or (path.suffix == ".py" and path.name != "__init__.py" and path.name not in layout)]
    assert missing == [], f"README's layout does not name {missing}"
    for folder in ("plugins/", "cuda_numba/", "contrib/", "tools/"):
        assert folder in layout
