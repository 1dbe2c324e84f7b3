"""README.md and the documentation site's pages: quick checks, no cluster."""

import os
import re
import shlex

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
@pytest.mark.xdist_group("install")  # The session's one install.
def test_the_readme_python_example_trains(installed, tmp_path):
    # Against `pip install <checkout>` (the session's `installed`), from an
    # empty folder, as a user runs it.
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
            installed.env,
            PYTHONPATH=str(installed.target),
            TMPDIR=str(temp),
            TF_CPP_MIN_LOG_LEVEL="2",
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) >= 0.95
    (model_dir,) = [p for p in temp.iterdir() if (p / "checkpoints").is_dir()]
    assert os.listdir(model_dir / "checkpoints")


# Code in the documentation: every Python snippet compiles and its imports
# resolve; every command of the training launcher parses and validates its
# flags (`tf_distbelief.launch.train.job_config`, no TensorFlow); the
# planner's and the manifest writer's commands run.
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LAUNCHER = ("launch/train.py", "tf-distbelief-train")


def _blocks(language=None):
    """`(page:line, language, text)` of each fenced block under docs/."""
    for path in _pages()[2:]:
        text = _read(path)
        for m in FENCE.finditer(text):
            if language is None or m.group(1) == language:
                line = text.count("\n", 0, m.start()) + 1
                yield f"{os.path.relpath(path, ROOT)}:{line}", m.group(1), m.group(2)


def _command_lines(text):
    """The block's shell commands, continuation lines joined, `&&` split."""
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # A quoted value over several lines (JSON).
                continue
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value
                words = words[1:]
            if words:
                yield words


def _launcher_args(words):
    for i, word in enumerate(words):
        if word.endswith(LAUNCHER):
            return words[i + 1 :]
    return None


def test_every_python_snippet_in_the_docs_compiles_and_its_imports_resolve():
    import ast
    import importlib

    checked = 0
    for where, _, text in _blocks("python"):
        tree = ast.parse(text, filename=where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}"
                    ), f"{where}: from {node.module} import {alias.name}"
        checked += 1
    assert checked >= 8


_PARSE_COMMANDS = """
import json, sys
from absl import flags
from tf_distbelief.launch import train

train.define_flags()
for argv in json.loads(sys.stdin.read()):
    flags.FLAGS.unparse_flags()
    try:
        flags.FLAGS(["train.py", *argv])
        train.job_config(["train.py"])
        print("ok")
    except Exception as e:
        print("refused:", type(e).__name__, str(e).splitlines()[0])
"""


def test_every_launcher_command_in_the_docs_parses_and_validates(tmp_path):
    import json
    import subprocess
    import sys

    commands = []
    for where, _, text in _blocks():
        for words in _command_lines(text):
            if words[:2] == ["printf", "--"] and ">" in words:  # A flag file.
                (tmp_path / words[-1]).write_text(words[2].replace("\\n", "\n"))
            args = _launcher_args(words)
            if args is not None:
                commands.append((where, args))
    assert len(commands) >= 14, commands
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_COMMANDS],
        input=json.dumps([args for _, args in commands]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    results = proc.stdout.splitlines()
    assert len(results) == len(commands), proc.stderr[-3000:]
    refused = [f"{w}: {r}" for (w, _), r in zip(commands, results) if r != "ok"]
    assert refused == []


def test_the_planner_and_manifest_commands_in_the_docs_run(tmp_path):
    import subprocess
    import sys

    runs = []
    for where, _, text in _blocks():
        for words in _command_lines(text):
            if words[:3] == ["python", "-m", "tf_distbelief.planner"]:
                runs.append((where, [sys.executable, *words[1:]]))
            elif len(words) > 1 and words[1] == "launch/k8s.py":
                runs.append((where, [sys.executable, *words[1:]]))
    assert len(runs) >= 2, runs
    for where, argv in runs:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert proc.returncode == 0, f"{where}: {proc.stderr[-2000:]}"


def test_the_tf_config_and_manifests_in_the_docs_are_valid():
    # A `TF_CONFIG` given with `export` goes through the cluster's own checks;
    # a Kubernetes manifest (a block starting `apiVersion:`) is YAML.
    import json

    import yaml

    from tf_distbelief.cluster import config

    tf_configs = manifests = 0
    for where, _, text in _blocks():
        exported = re.search(r"^export TF_CONFIG='(.*?)'$", text, re.M | re.S)
        if exported:
            config.tf_config_task(json.loads(exported.group(1)))
            tf_configs += 1
        if text.startswith("apiVersion:"):
            assert yaml.safe_load(text)["kind"], where
            manifests += 1
    assert tf_configs >= 1 and manifests >= 1
