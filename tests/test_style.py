"""Formatting and lint, checked by the same tool everyone runs (STYLE.md, habit 8)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "args", [["format", "--check"], ["check"]], ids=["format", "lint"]
)
def test_ruff(args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is installed with `pip install -e '.[test]'`"
    proc = subprocess.run(
        [ruff, *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
