"""The package's layout (issue 9): small modules, pure modules without
TensorFlow, the library apart from the repository's demo models and launcher."""

import ast
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_distbelief")
MAX_LINES = 450
# Pure modules: algorithms, schedules and NumPy references, testable with no
# cluster (STYLE.md, habit 1).
PURE_MODULES = [
    "tf_distbelief.adagrad.rule",
    "tf_distbelief.downpour.schedule",
    "tf_distbelief.downpour.push_rules.rule",
    "tf_distbelief.downpour.push_rules.reference",
    "tf_distbelief.downpour.push_rules.outer_nesterov",
    "tf_distbelief.downpour.push_rules.delay_compensation",
    "tf_distbelief.downpour.push_rules.staleness_scaled",
    "tf_distbelief.sandblaster.lbfgs",
    "tf_distbelief.sandblaster.lbfgs_state",
    "tf_distbelief.sandblaster.schedule",
    "tf_distbelief.sandblaster.two_loop",
    "tf_distbelief.sandblaster.vector_ops",
    "tf_distbelief.model_parallel.partition_math",
    "tf_distbelief.cluster.gpus",
    "tf_distbelief.errors",
    # The launch script's first line and start-up filter, before TensorFlow.
    "tf_distbelief.console",
]


def _package_files(folders=(PACKAGE,)):
    for top in folders:
        for folder, _, files in os.walk(top):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


def test_no_module_is_over_the_line_limit():
    long = {}
    for path in _package_files((PACKAGE, os.path.join(ROOT, "launch"))):
        with open(path) as f:
            count = sum(1 for _ in f)
        if count > MAX_LINES:
            long[os.path.relpath(path, ROOT)] = count
    assert long == {}


def test_the_library_never_imports_the_demo_models_or_the_launcher():
    offenders = []
    for path in _package_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in ("models", "launch"):
                    offenders.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert offenders == []


def test_pure_modules_import_where_tensorflow_cannot():
    # A meta-path finder that refuses TensorFlow (and tf_keras, which would
    # import it), installed before anything else is imported.
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorflow', 'tf_keras', 'keras'):\n"
        "            raise ImportError('tensorflow is not importable here')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        + "".join(f"import {m}\n" for m in PURE_MODULES)
        + "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_the_wheel_holds_only_tf_distbelief(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as archive:
        tops = {
            name.split("/")[0]
            for name in archive.namelist()
            if not name.split("/")[0].endswith(".dist-info")
        }
    assert tops == {"tf_distbelief"}
