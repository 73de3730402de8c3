"""docs/config.md documents every config key and is what the generator writes."""
import io
import sys
from pathlib import Path

from zkit.core.config.fields import config_fields
from zkit.core.config.load import section_paths

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from gen_config_doc import write  # noqa: E402

DOCS = ROOT / "docs" / "config.md"


def test_every_field_is_documented():
    text = DOCS.read_text(encoding="utf-8")
    missing = []
    for path, cls in section_paths().items():
        title = "## Top level" if not path else f"## `{path}`"
        assert title in text, f"section {title!r} missing from docs/config.md"
        body = text.split(title, 1)[1].split("\n## ", 1)[0]
        missing += [f"{path}.{f.name}" for f in config_fields(cls) if f"| `{f.name}` |" not in body]
    assert not missing, f"keys missing from docs/config.md: {missing}"


def test_docs_are_up_to_date():
    out = io.StringIO()
    write(out)
    assert DOCS.read_text(encoding="utf-8") == out.getvalue(), (
        "docs/config.md is stale: run python tools/gen_config_doc.py > docs/config.md"
    )
