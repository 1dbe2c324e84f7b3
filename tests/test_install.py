"""A pip install of the checkout, used from an empty folder: the version, the
`tf-distbelief-train` command and the demo models come from the installed
package, not from the repository."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One install (the module's fixture) for every test here, in one process.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install --target` of a copy of the checkout (offline: no build
    isolation, no dependencies; they come from this venv).

    Returns:
      (target folder, an empty folder to run in, the environment that finds
      tf_distbelief in the target only).
    """
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("install")
    # A copy, so that the build's folders stay out of the checkout.
    source = tmp / "source"
    shutil.copytree(
        os.path.join(ROOT, "tf_distbelief"),
        source / "tf_distbelief",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    target = tmp / "target"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    empty = tmp / "empty"
    empty.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target), TF_CPP_MIN_LOG_LEVEL="2")
    return target, empty, env


def _run(args, installed_, timeout=300):
    _, empty, env = installed_
    return subprocess.run(
        args, cwd=str(empty), env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_install_holds_only_tf_distbelief_and_its_command(installed):
    target, _, _ = installed
    tops = {n for n in os.listdir(target) if not n.endswith(".dist-info")}
    assert tops == {"tf_distbelief", "bin"}
    assert os.listdir(target / "bin") == ["tf-distbelief-train"]


def test_the_installed_version_is_the_packages(installed):
    target, _, _ = installed
    proc = _run(
        [
            sys.executable,
            "-c",
            "import importlib.util, tf_distbelief\n"
            "print(tf_distbelief.__version__)\n"
            "print(tf_distbelief.__file__)\n"
            "print(importlib.util.find_spec('models'))\n",
        ],
        installed,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, path, models = proc.stdout.split()
    with open(os.path.join(ROOT, "tf_distbelief", "__init__.py")) as f:
        assert f'__version__ = "{version}"' in f.read()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert path == str(target / "tf_distbelief" / "__init__.py")
    assert models == "None"  # No generic top-level name in site-packages.


@pytest.mark.parametrize("entry", ["command", "module"])
def test_the_installed_command_answers_help(installed, entry):
    target, _, _ = installed
    if entry == "command":  # The console script pip wrote.
        args = [sys.executable, str(target / "bin" / "tf-distbelief-train")]
    else:
        args = [sys.executable, "-m", "tf_distbelief.launch.train"]
    proc = _run([*args, "--help"], installed)
    # The module's docstring is the usage, then the command's own flags, the
    # Sandblaster flags among them.
    assert "tf-distbelief-train --model=digits" in proc.stdout, proc.stderr[-3000:]
    for flag in ("--model:", "--optimizer:", "--lbfgs_history:", "--downpour"):
        assert flag in proc.stdout
    assert "Traceback" not in proc.stderr


def test_the_demo_models_import_from_the_install(installed):
    target, _, _ = installed
    proc = _run(
        [
            sys.executable,
            "-c",
            "from tf_distbelief import demos\n"
            "from tf_distbelief.demos import (\n"
            "    blobs, digits, embedding, model_parallel, records, speech)\n"
            "print(demos.MODELS)\n"
            "print(digits.__file__)\n"
            "print(demos.spec('digits').name)\n",
        ],
        installed,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    models, path, name = proc.stdout.split("\n")[:3]
    assert models == "('digits', 'speech', 'embedding')"
    assert path == str(target / "tf_distbelief" / "demos" / "digits.py")
    assert name == "digits"
