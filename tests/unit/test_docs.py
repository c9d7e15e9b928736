from pathlib import Path

from cachefs.base.config import reference_markdown


def test_configuration_reference_is_current():
    doc = Path(__file__).parents[2] / "docs" / "CONFIGURATION.md"
    assert doc.read_text() == reference_markdown(), (
        "docs/CONFIGURATION.md is stale: python -c \"from cachefs.base.config import reference_markdown; "
        "open('docs/CONFIGURATION.md','w').write(reference_markdown())\""
    )
