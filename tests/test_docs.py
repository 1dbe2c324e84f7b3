"""README.md and the documentation site's pages: quick checks, no cluster."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
    ".venv/bin/python -m pytest -n 2 --dist loadgroup tests"
)
# Files that are not in the repository.
ABSENT_FILES = ("STYLE.md", "TF_NOTES.md", "PAPER.md")
# Markdown links and images: [text](target) and ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    pages = [README, os.path.join(ROOT, "benchmarks", "README.md")]
    for folder, _, files in os.walk(DOCS):
        pages += [os.path.join(folder, n) for n in sorted(files) if n.endswith(".md")]
    return pages


def _ids(paths):
    return [os.path.relpath(p, ROOT) for p in paths]


def _without_code(text):
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def test_readme_is_a_front_page():
    with open(README, encoding="utf-8") as f:
        lines = f.readlines()
    assert len(lines) <= 250


def test_readme_holds_the_test_command_that_ci_runs():
    assert TEST_COMMAND in _read(README)
    assert TEST_COMMAND in _read(os.path.join(ROOT, ".ci", "run"))


@pytest.mark.parametrize("path", _pages(), ids=_ids(_pages()))
def test_no_work_item_numbers_or_absent_files(path):
    text = _read(path)
    assert not re.search(r"issue\s*#?\d+", text, re.IGNORECASE)
    for name in ABSENT_FILES:
        assert name not in text


@pytest.mark.parametrize("path", _pages(), ids=_ids(_pages()))
def test_relative_links_point_at_files(path):
    missing = []
    for target in LINK.findall(_without_code(_read(path))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # A URL, or an anchor on the same page.
        file_part = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(os.path.dirname(path), file_part)):
            missing.append(target)
    assert missing == []


@pytest.mark.slow
def test_the_readme_python_example_trains(tmp_path):
    import subprocess
    import sys

    blocks = re.findall(r"^```python\n(.*?)^```", _read(README), re.S | re.M)
    assert len(blocks) == 1
    # As written: a new model_dir each run (`tempfile`, here under `temp`),
    # from an empty folder (the demo models come with the package).
    assert "model_dir=tempfile.mkdtemp()" in blocks[0]
    empty, temp = tmp_path / "empty", tmp_path / "temp"
    empty.mkdir()
    temp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", blocks[0] + "\nimport os; os._exit(0)\n"],
        cwd=str(empty),
        env=dict(
            os.environ, PYTHONPATH=ROOT, TMPDIR=str(temp), TF_CPP_MIN_LOG_LEVEL="2"
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) >= 0.95
    (model_dir,) = [p for p in temp.iterdir() if (p / "checkpoints").is_dir()]
    assert os.listdir(model_dir / "checkpoints")
