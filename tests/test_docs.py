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
# The benchmark pages: the current runs and the runs they replaced.
BENCHMARK_PAGES = ("benchmarks/README.md", "benchmarks/earlier-runs.md")
# Files that are not in the repository.
ABSENT_FILES = ("STYLE.md", "TF_NOTES.md", "PAPER.md")
# Markdown links and images: [text](target) and ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    pages = [README] + [os.path.join(ROOT, p) for p in BENCHMARK_PAGES]
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


def test_readme_main_job_is_the_one_the_tests_run():
    # tests/job/test_launch.py runs `README_ARGS` from the install and checks
    # the accuracy the README states beside the command.
    from tests.fixtures.launch import README_ARGS, readme_accuracy

    commands = [
        words
        for _, _, text in _blocks(pages=[README])
        for words in _command_lines(text)
        if words[0] == "tf-distbelief-train" and "--model=digits" in words
    ]
    assert commands[0] == ["tf-distbelief-train", *README_ARGS]
    low, high = readme_accuracy()
    assert 0.9 < low <= high < 1.0


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


# Code in the documentation (README.md, docs/ and the benchmark pages): every
# fenced block is checked by its kind. Python snippets compile, their imports
# resolve and so does every dotted name they use from a module; every command
# of the training launcher parses and validates its flags
# (`tf_distbelief.launch.train.job_config`, no TensorFlow); the planner's and
# the manifest writer's commands run; `python -c` code compiles, `python -m`
# modules and `python` scripts exist, a benchmark command's flags are the
# script's; YAML, JSON and `TF_CONFIG` parse (and pass the cluster's checks);
# `text` blocks are program output, not code.
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
LAUNCHER = ("launch/train.py", "tf-distbelief-train")
# Programs whose commands the pages show and no test runs: the install and
# test steps, and tools outside the package (their commands are examples).
OTHER_PROGRAMS = {
    "python3",  # `python3 -m venv .venv`
    ".",  # `. .venv/bin/activate`
    "pip",
    ".venv/bin/pip",
    ".venv/bin/python",  # The test command, checked against `.ci/run` above.
    "printf",  # A flag file, written for the launcher commands.
    "export",  # `TF_CONFIG`, checked by its own test.
    "kubectl",
    "docker",
    "tensorboard",
}
SHELL = ("", "bash", "sh", "shell")
DOCKERFILE = re.compile(r"^(FROM|COPY|RUN|ENV|ARG|WORKDIR|CMD|ENTRYPOINT) ")


def _blocks(language=None, pages=None):
    """`(page:line, language, text)` of each fenced block of the pages.

    Args:
      language: only the blocks of this language (`""`: no language given).
      pages: the pages (default: README.md and docs/; the benchmark pages'
        blocks are their own commands).
    """
    if pages is None:
        pages = [p for p in _pages() if _rel(p) not in BENCHMARK_PAGES]
    for path in pages:
        text = _read(path)
        for m in FENCE.finditer(text):
            if language is None or m.group(2) == language:
                line = text.count("\n", 0, m.start()) + 1
                body = re.sub(rf"^{m.group(1)}", "", m.group(3), flags=re.M)
                yield f"{_rel(path)}:{line}", m.group(2), body


def _rel(path):
    return os.path.relpath(path, ROOT)


def _command_lines(text):
    """The block's shell commands (word lists), continuation lines joined,
    `&&` and `;` split outside quotes, `VAR=value` prefixes dropped."""
    pending = ""
    for line in text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # A quoted value over several lines (JSON).
            continue
        pending = ""
        words = []
        for token in [*tokens, ";"]:
            if token not in ("&&", ";"):
                words.append(token)
                continue
            while words and re.match(r"^[A-Za-z_]+=", words[0]):  # VAR=value
                words = words[1:]
            if words:
                yield words
            words = []


def _launcher_args(words):
    for i, word in enumerate(words):
        if word.endswith(LAUNCHER):
            return words[i + 1 :]
    return None


def _names_bound(tree):
    """`(modules, others)`: the names a snippet binds to imported modules
    (`{name: dotted module}`) and every other name it binds."""
    import ast

    modules, others = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    modules[top] = top
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            others.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            others.add(node.name)
        elif isinstance(node, ast.arg):
            others.add(node.arg)
    return modules, others


def _dotted_names(tree):
    """Every `name.attr.attr...` of a snippet, longest only: `(name, [attrs])`."""
    import ast

    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            attrs = []
            while isinstance(node, ast.Attribute):
                attrs.insert(0, node.attr)
                node = node.value
            if isinstance(node, ast.Name):
                yield node.id, attrs


def _resolve(dotted):
    """The object a dotted path names: a module, or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_python_snippet_in_the_docs_compiles_and_its_imports_resolve():
    # Each snippet names what it uses: a dotted name starts at a module it
    # imports (and resolves there, so a renamed function fails here) or at
    # a name it binds; a name the snippet never binds is the reader's own
    # data (`x`, `model`), never the root of a dotted name.
    import ast
    import builtins

    checked = 0
    for where, _, text in _blocks("python"):
        tree = ast.parse(text, filename=where)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    _resolve(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    _resolve(alias.name)
        modules, others = _names_bound(tree)
        for name, attrs in _dotted_names(tree):
            if name in modules and name not in others:
                try:
                    _resolve(".".join([modules[name], *attrs]))
                except (ImportError, AttributeError) as e:
                    raise AssertionError(f"{where}: {name}.{'.'.join(attrs)}") from e
            else:
                assert name in others or hasattr(builtins, name), (
                    f"{where}: {name}.{'.'.join(attrs)} uses {name!r}, which the "
                    "snippet neither imports nor binds"
                )
        checked += 1
    assert checked >= 9


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


def _benchmark_flags():
    """Every flag the benchmark scripts define: absl `DEFINE_*("name", ...)`,
    or a name kept in a constant (`RATES_FLAG = "nic_rates"`)."""
    names = {"help", "helpfull", "flagfile"}
    folder = os.path.join(ROOT, "benchmarks")
    for name in os.listdir(folder):
        if name.endswith(".py"):
            source = _read(os.path.join(folder, name))
            names.update(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
            names.update(re.findall(r"^\w+_FLAG = \"(\w+)\"$", source, re.M))
    return names


def _command_problem(words, page):
    """Why a shell command of `page` is not checked, or None when it is:
    here (`python -c`, `-m`, scripts, benchmark flags) or by the tests
    above (the launcher's flags, the planner and manifest commands run)."""
    import importlib.util

    if _launcher_args(words) is not None or words[0] in OTHER_PROGRAMS:
        return None
    if words[0] != "python" or len(words) < 2:
        return f"a command of an unknown program: {shlex.join(words)}"
    if words[1] == "-c":
        try:
            compile(words[2], page, "exec")
        except SyntaxError as e:
            return f"python -c: {e}"
        return None
    if words[1] == "-m":
        found = importlib.util.find_spec(words[2]) is not None
        return None if found else f"no module {words[2]}"
    if not os.path.isfile(os.path.join(ROOT, words[1])):
        return f"no script {words[1]}"
    if page == "benchmarks/README.md":  # The current runs: today's flags.
        defined = _benchmark_flags()
        for word in words[2:]:
            flag = re.match(r"^--(no)?(\w+)", word)
            if flag and not {"".join(flag.groups("")), flag.group(2)} & defined:
                return f"{words[1]}: no flag {word}"  # `--noX`: X's negation.
    return None


def _block_kind(language, text):
    """What a fenced block holds: `python`, `shell`, `yaml`, `json`,
    `dockerfile`, or `text` (program output, not code)."""
    if language in ("yaml", "json", "python", "dockerfile", "text"):
        return language
    if text.startswith("apiVersion:"):
        return "yaml"
    if DOCKERFILE.match(text):
        return "dockerfile"
    if language in SHELL:
        first = next(_command_lines(text), None)
        if not language and (first is None or _unknown_program(first)):
            return "text"  # Untagged program output: the console's lines.
        return "shell"
    return language


def _unknown_program(words):
    problem = _command_problem(words, "")
    return problem is not None and problem.startswith("a command of an unknown")


def test_every_block_in_the_docs_is_code_that_a_test_checks_or_output():
    import json

    import yaml

    from tf_distbelief.cluster import config

    kinds = {}
    problems = []
    for where, language, text in _blocks(pages=_pages()):
        kind = _block_kind(language, text)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "shell":
            for words in _command_lines(text):
                problem = _command_problem(words, where.split(":")[0])
                if problem:
                    problems.append(f"{where}: {problem}")
        elif kind == "yaml":
            for document in yaml.safe_load_all(text):
                assert document["kind"], where
        elif kind == "json":
            value = json.loads(text)
            if "cluster" in value:
                config.tf_config_task(value)
        elif kind == "dockerfile":
            for line in text.splitlines():
                assert DOCKERFILE.match(line) or not line.strip(), f"{where}: {line}"
        elif kind not in ("python", "text"):  # python: the snippet test above.
            problems.append(f"{where}: a block of unknown kind {language!r}")
    assert problems == []
    assert kinds["shell"] >= 40 and kinds["python"] >= 9, kinds
