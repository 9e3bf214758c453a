"""docs/reference/supported-models.md holds the table the families' descriptors make (``python -m powerinfer_tools.models``)."""

import re
from pathlib import Path

from powerinfer_tools.models import FAMILIES
from powerinfer_tools.models.__main__ import table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "supported-models.md"


def test_the_page_holds_the_descriptors_table():
    page = PAGE.read_text(encoding="utf-8")
    shown = re.search(r"<!-- the table: [^\n]*-->\n(.*?)<!-- end of the table -->", page, re.S)
    assert shown is not None and shown.group(1) == table(), "run: python -m powerinfer_tools.models"


def test_every_family_has_a_row_and_names_its_classes():
    rows = table().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [family.name for family in FAMILIES]
    assert all(family.hf_classes[0] in row for family, row in zip(FAMILIES, rows))
