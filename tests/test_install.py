"""A pip install of the checkout, used from an empty folder: the version, the
`tf-distbelief-train` command and the demo models come from the installed
package, not from the repository.

The same install runs the README's main job (the installed command, to the
README's test accuracy: tests/job/test_launch.py) and its Python example
(tests/test_docs.py).
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One install (the session's `installed`, tests/conftest.py) for every test
# here and the others that use it, in one process.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]


def _run(args, installed_, timeout=300):
    return subprocess.run(
        args,
        cwd=str(installed_.empty),
        env=installed_.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_install_holds_only_tf_distbelief_and_its_command(installed):
    target = installed.target
    tops = {n for n in os.listdir(target) if not n.endswith(".dist-info")}
    assert tops == {"tf_distbelief", "bin"}
    assert os.listdir(target / "bin") == ["tf-distbelief-train"]


def test_the_installed_version_is_the_packages(installed):
    target = installed.target
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
    if entry == "command":  # The console script pip wrote.
        args = [sys.executable, installed.command]
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
    target = installed.target
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
