"""Formatting and lint, checked by the same tool everyone runs (STYLE.md, habit 8)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "args", [["format", "--check"], ["check"]], ids=["format", "lint"]
)
def test_ruff(args):
    # `python -m ruff`: the ruff of this interpreter's environment, installed by
    # `pip install -e '.[test]'`, whether or not that environment is on PATH.
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
