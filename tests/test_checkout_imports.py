"""A checkout put on PYTHONPATH runs its own code: formats/ and solver/ too, which pyproject maps into the package.

The examples that compare two versions (``examples/prompt_ab.py --before``, ``startup_times.py --before``) run the
other checkout so; before, its ``powerinfer_tools.formats`` and ``.solver`` were the editable install's, and a
change there was measured against itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_checkout_on_pythonpath_imports_its_own_formats_and_solver(tmp_path):
    for folder in ("powerinfer_tools", "formats", "solver"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import powerinfer_tools.formats.model_spec as m, powerinfer_tools.solver as s; "
            "print(m.__file__); print(s.__file__)")
    out = subprocess.run([sys.executable, "-P", "-c", code], env={"PYTHONPATH": str(tmp_path), "PATH": ""},
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert out == [str(tmp_path / "formats" / "model_spec.py"), str(tmp_path / "solver" / "__init__.py")]

