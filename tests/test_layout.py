"""The package's layout: two floors around the algorithms, one import path per
public name, modules of one concept, pure modules without TensorFlow, the
library apart from the demo models and the launcher that ship with it."""

import ast
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_distbelief")
# A module that needs more splits along its concepts (docstrings and comments
# are not counted: they never decide where a module ends).
MAX_CODE_LINES = 600
MAX_MODULE_DOCSTRING_LINES = 60
MAX_TOP_LEVEL_MODULES = 10
# The algorithms, and the layers above them that must not know them.
ALGORITHMS = ("downpour", "sandblaster", "model_parallel")
ABOVE_ALGORITHMS = ("keras3", "job")
# Pure modules: algorithms, schedules and NumPy references, testable with no
# cluster.
PURE_MODULES = [
    "tf_distbelief.checks",
    "tf_distbelief.hooks",
    "tf_distbelief.paths",
    "tf_distbelief.partitioning",
    "tf_distbelief.faults.settings",
    "tf_distbelief.fit.lines",
    "tf_distbelief.job.config",
    "tf_distbelief.adagrad.rule",
    "tf_distbelief.downpour.config_fields",
    "tf_distbelief.downpour.schedule",
    "tf_distbelief.downpour.update_stream",
    "tf_distbelief.downpour.position_codes",
    "tf_distbelief.downpour.report",
    "tf_distbelief.downpour.push_rules.rule",
    "tf_distbelief.downpour.push_rules.reference",
    "tf_distbelief.downpour.push_rules.outer_nesterov",
    "tf_distbelief.downpour.push_rules.delay_compensation",
    "tf_distbelief.downpour.push_rules.staleness_scaled",
    "tf_distbelief.downpour.push_rules.stale_damping",
    "tf_distbelief.downpour.push_rules.top_k",
    "tf_distbelief.downpour.push_rules.quantize",
    "tf_distbelief.sandblaster.lbfgs",
    "tf_distbelief.sandblaster.lbfgs_state",
    "tf_distbelief.sandblaster.schedule",
    "tf_distbelief.sandblaster.two_loop",
    "tf_distbelief.sandblaster.vector_ops",
    "tf_distbelief.model_parallel.partition_math",
    "tf_distbelief.cluster.local.gpus",
    "tf_distbelief.cluster.local.proc_stat",
    # Kubernetes manifests, and a JobSet pod's cluster from its identity.
    "tf_distbelief.cluster.k8s.manifest",
    "tf_distbelief.cluster.k8s.jobset",
    "tf_distbelief.cluster.k8s.tfjob",
    "tf_distbelief.cluster.jobset_pod",
    "tf_distbelief.planner.records",
    "tf_distbelief.planner.cost_model",
    "tf_distbelief.planner.host",
    "tf_distbelief.errors",
    # The launch script's first line and start-up filter, before TensorFlow.
    "tf_distbelief.console",
    # The launcher parses its flags, and reads the demo models' names and
    # sizes, before TensorFlow loads.
    "tf_distbelief.demos",
    "tf_distbelief.launch.train",
]
# Shipped with the library, apart from it: the demo models and the launcher.
APART = ("tf_distbelief.demos", "tf_distbelief.launch")


def _package_files(folders=(PACKAGE,)):
    for top in folders:
        for folder, _, files in os.walk(top):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


def _docstring_node(node):
    """The statement holding `node`'s docstring (a module, class or function),
    or None."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[0]
    return None


def _code_lines(source: str) -> tuple[int, int]:
    """(lines of code, lines of the module docstring) of a module's source.

    Blank lines, comments and every docstring (module, class, function) are
    not code.
    """
    tree = ast.parse(source)
    docstrings = set()
    module_doc = 0
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            doc = _docstring_node(node)
            if doc is not None:
                lines = range(doc.lineno, doc.end_lineno + 1)
                docstrings.update(lines)
                if isinstance(node, ast.Module):
                    module_doc = len(lines)
    code = 0
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and number not in docstrings:
            code += 1
    return code, module_doc


def test_code_lines_and_module_docstrings_are_bounded():
    long = {}
    for path in _package_files((PACKAGE, os.path.join(ROOT, "launch"))):
        with open(path) as f:
            code, doc = _code_lines(f.read())
        if code > MAX_CODE_LINES or doc > MAX_MODULE_DOCSTRING_LINES:
            long[os.path.relpath(path, ROOT)] = (code, doc)
    assert long == {}, f"(code lines, module docstring lines) over {MAX_CODE_LINES}"


def test_code_lines_skip_docstrings_and_comments():
    source = (
        '"""Doc.\n\nMore."""\n\n# why\nimport os\n\n\n'
        'def f():\n    """F."""\n    return os.sep  # trailing\n'
    )
    assert _code_lines(source) == (3, 3)


def _imports(path: str) -> list[str]:
    """The absolute module names `path` imports (`from tf_distbelief import x`
    counts as `tf_distbelief.x`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _layer_imports(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    offenders = []
    for path in _package_files((os.path.join(PACKAGE, layer),)):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tf_distbelief" and len(parts) > 1 and parts[1] in forbidden:
                offenders.append(f"{os.path.relpath(path, ROOT)}: {name}")
    return offenders


def test_two_floors_fit_over_and_faults_under_the_algorithms():
    top = sorted(os.listdir(PACKAGE))
    assert {"fit", "faults"} <= {
        n for n in top if os.path.isfile(os.path.join(PACKAGE, n, "__init__.py"))
    }
    modules = [n for n in top if n.endswith(".py")]
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    # The fit layer trains any model; an algorithm reaches it through the
    # `hooks.FitHooks` its `install` attaches, never by an import.
    assert _layer_imports("fit", ALGORITHMS + ABOVE_ALGORITHMS) == []
    # The faults layer sits under the algorithms and the fit layer.
    assert _layer_imports("faults", ALGORITHMS + ABOVE_ALGORITHMS + ("fit",)) == []
    # The algorithms never reach up.
    for algorithm in ALGORITHMS:
        assert _layer_imports(algorithm, ABOVE_ALGORITHMS + ("fit",)) == []


def test_the_layout_test_sees_an_arrow_back_up(tmp_path, monkeypatch):
    fake = tmp_path / "tf_distbelief" / "fit"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from tf_distbelief.downpour import replica\n")
    monkeypatch.setattr(
        sys.modules[__name__], "PACKAGE", str(tmp_path / "tf_distbelief")
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert _layer_imports("fit", ALGORITHMS) == [
        "tf_distbelief/fit/bad.py: tf_distbelief.downpour",
        "tf_distbelief/fit/bad.py: tf_distbelief.downpour.replica",
    ]


def _import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from every `import` and
    `from ... import` statement, at module level or inside a function.

    `from p import m` is an edge to module `p.m` where there is one, else to
    `p`. A package's `__init__` importing a module inside it is no edge: the
    package is its children's face, not a module they depend on.
    """
    modules = {_module_name(path): path for path in _package_files((PACKAGE,))}
    packages = {name for name, path in modules.items() if path.endswith("__init__.py")}
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        here = name if name in packages else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    child = f"{base}.{a.name}"
                    targets.add(child if child in modules else base)
        graph[name] = {
            t
            for t in targets
            if t in modules
            and t != name
            and not (name in packages and t.startswith(name + "."))
        }
    return graph


def _import_circles() -> list[list[str]]:
    """Each circle of `_import_graph`: its modules, sorted (Tarjan's strongly
    connected components of more than one module)."""
    graph = _import_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_import_circle():
    # A module that imports another which (through others) imports it back
    # holds a concept in the wrong place: the shared part belongs in a module
    # both import. Imports inside functions count.
    assert _import_circles() == []


def test_the_layout_test_sees_an_import_circle(tmp_path, monkeypatch):
    fake = tmp_path / "tf_distbelief"
    (fake / "cluster").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    # A face importing its own children: no circle.
    (fake / "cluster" / "__init__.py").write_text(
        "from tf_distbelief.cluster import config\n"
    )
    (fake / "cluster" / "config.py").write_text(
        "from tf_distbelief import checks\n\n"
        "def source():\n    from tf_distbelief.cluster import jobset\n"
    )
    (fake / "cluster" / "jobset.py").write_text(
        "from tf_distbelief.cluster.manifest import PORT\n"
    )
    (fake / "cluster" / "manifest.py").write_text(
        "import tf_distbelief.cluster.config\nPORT = 2222\n"
    )
    (fake / "checks.py").write_text("import tf_distbelief.cluster\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(fake))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert _import_circles() == [
        [
            "tf_distbelief.cluster.config",
            "tf_distbelief.cluster.jobset",
            "tf_distbelief.cluster.manifest",
        ]
    ]
    (fake / "cluster" / "manifest.py").write_text("PORT = 2222\n")
    assert _import_circles() == []


def test_the_model_dir_layout_has_one_owner():
    # Folder names of a model_dir are spelled in `paths` alone.
    spelled = []
    for path in _package_files():
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if '"checkpoints"' in line or "'checkpoints'" in line:
                    spelled.append(f"{os.path.relpath(path, ROOT)}:{number}")
    assert spelled == ["tf_distbelief/paths.py:" + spelled[0].split(":")[1]]
    assert spelled[0].startswith("tf_distbelief/paths.py")


def _all_of(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return [e.value for e in node.value.elts]
    return []


def _faces() -> dict[str, dict[str, str]]:
    """Each package `__init__`'s exports: {package: {name: defining module}}."""
    faces = {}
    for path in _package_files():
        if os.path.basename(path) != "__init__.py":
            continue
        package = _module_name(path)
        with open(path) as f:
            tree = ast.parse(f.read())
        lazy, imported = {}, {}
        for node in ast.walk(tree):
            if (  # `_lazy.exports(__name__, {name: module}, ...)`
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "exports"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Dict)
            ):
                for k, v in zip(node.args[1].keys, node.args[1].values):
                    lazy[k.value] = f"{package}.{v.value}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    imported[a.asname or a.name] = node.module
        exported = _all_of(tree)
        faces[package] = lazy or {n: m for n, m in imported.items() if n in exported}
    return faces


def _package_imports(tree: ast.Module) -> set[str]:
    """The names a module's top level binds by importing from tf_distbelief
    (`from tf_distbelief.x import y as z`, `import tf_distbelief.x`, and any
    relative import)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tf_distbelief":
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] == "tf_distbelief"
        ):
            names.update(a.asname or a.name for a in node.names)
    return names


def _re_exports(tree: ast.Module) -> list[str]:
    """Public top-level names bound by an assignment whose value is only a name
    or an attribute of something imported from tf_distbelief (`X = other.X`,
    `X = other_module.Y`, `X = Y` after `from other import Y`): a second
    import path to an object another module defines."""
    imported = _package_imports(tree)
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in imported):
            continue
        found += [
            t.id
            for t in targets
            if isinstance(t, ast.Name) and not t.id.startswith("_")
        ]
    return found


def _defined(tree: ast.Module) -> set[str]:
    """The names a module's top level defines: functions, classes and
    assignments that are not re-exports."""
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    return defined - set(_re_exports(tree))


def _shims(paths) -> list[str]:
    """`module.name` for each name a module's `__all__` lists but does not
    define, and each public name a module binds by re-exporting another
    module's object by assignment."""
    shims = []
    for path in paths:
        if os.path.basename(path) == "__init__.py":
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        defined = _defined(tree)
        names = sorted(
            set(_re_exports(tree)) | {n for n in _all_of(tree) if n not in defined}
        )
        shims += [f"{_module_name(path)}.{n}" for n in names]
    return shims


def test_every_public_name_has_one_import_path():
    # A module's `__all__` lists only what the module defines, and no module
    # re-exports another's object by assignment (no shims); a package's face
    # re-exports only from inside the package, and a name is on one face only.
    assert _shims(_package_files()) == []
    seen: dict[str, str] = {}
    twice, outside, undefined = [], [], []
    for package, names in sorted(_faces().items()):
        for name, module in names.items():
            if not module.startswith(package + "."):
                outside.append(f"{package}.{name} from {module}")
            # The face names the module that defines the object.
            base = os.path.join(ROOT, *module.split("."))
            source = base + ".py"
            if not os.path.exists(source):
                source = os.path.join(base, "__init__.py")
            with open(source) as f:
                if name not in _defined(ast.parse(f.read())):
                    undefined.append(f"{package}.{name} from {module}")
            # One object (its defining module and name), one face.
            defined = f"{module}.{name}"
            if defined in seen:
                twice.append(f"{defined}: {seen[defined]} and {package}")
            seen[defined] = package
    assert outside == []
    assert undefined == []
    assert twice == []


def test_the_layout_test_sees_a_re_export_by_assignment(tmp_path, monkeypatch):
    fake = tmp_path / "tf_distbelief" / "sandblaster"
    fake.mkdir(parents=True)
    (fake / "vector_ops.py").write_text("class VectorOps:\n    pass\n")
    (fake / "lbfgs.py").write_text(
        "from tf_distbelief.sandblaster import vector_ops\n"
        "from tf_distbelief.sandblaster.vector_ops import VectorOps as Ops\n"
        "import numpy as np\n"
        "\n"
        '__all__ = ["minimize"]\n'
        "VectorOps = vector_ops.VectorOps\n"
        "SameOps = Ops\n"
        "_private = vector_ops.VectorOps\n"
        "FLOAT = np.float64\n"
        "RULE = minimize = len\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    # Public aliases of tf_distbelief objects are shims, listed in `__all__`
    # or not; a private alias, an alias of another library's object and a
    # local name are not.
    assert _shims(_package_files((str(tmp_path / "tf_distbelief"),))) == [
        "tf_distbelief.sandblaster.lbfgs.SameOps",
        "tf_distbelief.sandblaster.lbfgs.VectorOps",
    ]


def test_every_public_error_is_a_distbelief_error_at_the_top_level():
    import tf_distbelief as tfdb

    errors = []
    for path in _package_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                if not node.name.startswith("_"):
                    errors.append(node.name)
    assert sorted(errors) == sorted(n for n in tfdb.__all__ if n.endswith("Error"))
    for name in errors:
        assert issubclass(getattr(tfdb, name), tfdb.DistBeliefError), name


def _inline_argument_messages(paths) -> list[str]:
    """`path:line` of each `raise` outside `checks` whose message text (a
    string constant or f-string part) says an argument or a backticked name
    "must be": such a message is `checks.argument_error`'s to write."""
    offenders = []
    for path in paths:
        rel = os.path.relpath(path, ROOT)
        if rel == os.path.join("tf_distbelief", "checks.py"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and node.exc is not None):
                continue
            texts = [
                n.value
                for n in ast.walk(node.exc)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            if any("must be" in t and ("`" in t or "Argument" in t) for t in texts):
                offenders.append(f"{rel}:{node.lineno}")
    return offenders


def test_argument_messages_have_one_owner():
    # Every refused argument is a `checks.ArgumentError` with the house
    # message ("Argument `name` must be <rule>. Received: <value!r>"),
    # written by `checks` alone.
    assert _inline_argument_messages(_package_files()) == []


def test_the_layout_test_sees_an_inline_argument_message(tmp_path, monkeypatch):
    fake = tmp_path / "tf_distbelief"
    fake.mkdir()
    (fake / "checks.py").write_text(
        'def f(x):\n    raise ValueError(f"Argument `x` must be 1. Received: {x}")\n'
    )
    (fake / "bad.py").write_text(
        "from tf_distbelief import checks\n"
        "\n"
        "def f(x, y):\n"
        "    if x < 0:\n"
        '        raise ValueError(f"Argument `x` must be >= 0. Received: {x!r}")\n'
        "    if not y:\n"
        "        raise TypeError(\n"
        '            f"`y` must be set "\n'
        '            "(a name)."\n'
        "        )\n"
        "    if x > 9:\n"
        '        raise checks.argument_error("x", "<= 9", x)\n'
        "    if x == 5:\n"
        '        raise TypeError(f"Argument `n` must be an int. Received: {x!r}")\n'
        '    raise ValueError("The weather must be fine.")\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert _inline_argument_messages(_package_files((str(fake),))) == [
        "tf_distbelief/bad.py:5",
        "tf_distbelief/bad.py:7",
        "tf_distbelief/bad.py:14",
    ]


def test_no_test_module_imports_another():
    tests = os.path.join(ROOT, "tests")
    offenders = []
    for path in _package_files((tests,)):
        for name in _imports(path):
            leaf = name.split(".")[-1]
            if name.startswith("tests") and leaf.startswith("test_"):
                offenders.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert offenders == []


def test_class_swaps_and_method_overrides_live_in_the_internals():
    # Outside `tf_internals`, no object's class is swapped and no attribute is
    # forced past its class (`object.__setattr__`), except a frozen
    # dataclass initialising itself.
    offenders = []
    for path in _package_files():
        rel = os.path.relpath(path, ROOT)
        if rel.startswith("tf_distbelief/tf_internals/"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "__class__"
                for t in node.targets
            ):
                offenders.append(f"{rel}:{node.lineno}: __class__ =")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__setattr__"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "object"
                and not (
                    node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "self"
                )
            ):
                offenders.append(f"{rel}:{node.lineno}: object.__setattr__")
    assert offenders == []


def test_tensorflow_internals_live_in_one_place():
    offenders = []
    for path in _package_files():
        rel = os.path.relpath(path, ROOT)
        if rel.startswith("tf_distbelief/tf_internals/"):
            continue
        for name in _imports(path):
            if name.startswith("tensorflow.python"):
                offenders.append(f"{rel}: {name}")
    assert offenders == []


def _apart(name: str, packages=APART) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_library_never_imports_the_demo_models_or_the_launcher():
    # The library proper (every module outside `APART`) imports neither, nor
    # the repository's folders; the demo models never import the launcher.
    offenders = []
    for path in _package_files():
        module = _module_name(path)
        forbidden = ("tf_distbelief.launch",) if _apart(module) else APART
        if _apart(module, ("tf_distbelief.launch",)):
            continue
        for name in _imports(path):
            if _apart(name, forbidden) or name.split(".")[0] in ("models", "launch"):
                offenders.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert offenders == []
    assert {"demos", "launch"} <= set(os.listdir(PACKAGE))


def _python_ok(code: str) -> str:
    """The stdout of `python -c code` in the repository root, which must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


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
    assert _python_ok(code).strip() == "ok"


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
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith("/entry_points.txt")]
        commands = archive.read(entry_points).decode()
    tops = {
        name.split("/")[0]
        for name in names
        if not name.split("/")[0].endswith(".dist-info")
    }
    assert tops == {"tf_distbelief"}
    # The demo models, the launcher and its command ship with the library.
    assert {"tf_distbelief/demos/digits.py", "tf_distbelief/launch/train.py"} <= set(
        names
    )
    assert "tf-distbelief-train = tf_distbelief.launch.train:main" in commands


# Fault policies every Keras shares: none of them imports tf_keras (their
# tf_keras side is `faults.tf_keras_fit`).
NEUTRAL_FAULTS = [
    "tf_distbelief.faults.checkpoint_contents",
    "tf_distbelief.faults.exactly_once",
    "tf_distbelief.faults.goodput",
    "tf_distbelief.faults.nonfinite",
    "tf_distbelief.faults.recovery",
    "tf_distbelief.faults.resume",
]
MAX_FUNCTION_LINES = 80


def _keras3_training_modules() -> list[str]:
    folder = os.path.join(PACKAGE, "keras3")
    return sorted(
        f"tf_distbelief.keras3.{name[: -len('.py')]}"
        for name in os.listdir(folder)
        if name.startswith("training") and name.endswith(".py")
    )


def test_keras3_training_and_the_fault_policies_import_no_tf_keras():
    modules = _keras3_training_modules() + NEUTRAL_FAULTS
    assert "tf_distbelief.keras3.training" in modules
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tf_keras'))\n"
    )
    assert _python_ok(code).strip().splitlines()[-1] == "[]"


def _function_code_lines(node) -> int:
    """Lines of a function but its docstring (its signature and body)."""
    lines = node.end_lineno - node.lineno + 1
    doc = _docstring_node(node)
    if doc is not None:
        lines -= doc.end_lineno - doc.lineno + 1
    return lines


def test_keras3_training_functions_are_short():
    # A function that needs splitting along its concepts (setup, the epochs,
    # checkpoints, evaluation); its docstring is not counted, as above.
    long = {}
    for module in _keras3_training_modules():
        path = os.path.join(ROOT, *module.split(".")) + ".py"
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _function_code_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long[f"{module}.{node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines"


def test_checkpoint_keys_are_spelled_in_one_place():
    # What a checkpoint holds and how its keys are named: `checkpoint_contents`.
    spelled = set()
    for path in _package_files():
        with open(path) as f:
            if "ATTRIBUTES/VARIABLE_VALUE" in f.read():
                spelled.add(os.path.relpath(path, ROOT))
    assert spelled == {"tf_distbelief/faults/checkpoint_contents.py"}
