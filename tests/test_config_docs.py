"""docs/config.md documents every config key and is what the generator writes."""
import io
from pathlib import Path

from zkit.core.config.docgen import write
from zkit.core.config.fields import config_fields
from zkit.core.config.load import builtin_section_paths

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_every_field_is_documented():
    text = DOCS.read_text(encoding="utf-8")
    missing = []
    for path, cls in builtin_section_paths().items():
        title = "## Top level" if not path else f"## `{path}`"
        assert title in text, f"section {title!r} missing from docs/config.md"
        body = text.split(title, 1)[1].split("\n## ", 1)[0]
        missing += [f"{path}.{f.name}" for f in config_fields(cls) if f"| `{f.name}` |" not in body]
    assert not missing, f"keys missing from docs/config.md: {missing}"


def test_docs_are_up_to_date():
    out = io.StringIO()
    write(out)
    assert DOCS.read_text(encoding="utf-8") == out.getvalue(), (
        "docs/config.md is stale: run python -m zkit.core.config.docgen > docs/config.md"
    )
