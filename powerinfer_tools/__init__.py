"""powerinfer-tools: activation-sparse LLM inference toolkit (profile, predict, place, run)."""

from pathlib import Path

__version__ = "0.1.0"

# pyproject maps formats/ and solver/, folders beside this one, into the package: an install puts them inside it.
# A checkout run as it is (put on PYTHONPATH, as the examples that compare two checkouts do) finds them beside it,
# its own, where Python would otherwise take an editable install's.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "formats").is_dir() and (_HERE.parent / "formats" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))
