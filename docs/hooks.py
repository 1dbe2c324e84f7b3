"""MkDocs hook: the API reference pages, generated at build time.

The public names of each package are read statically (with `ast`, never
importing TensorFlow) from its `__init__.py`: the name -> module mapping given
to `_lazy.exports`, or the `from ... import` lines of the names in `__all__`.
One page per package lists its public names, each rendered by mkdocstrings
from the module that defines it today, so the reference follows the code when
modules move. The benchmark figures of `benchmarks/results/` are added to the
site beside `benchmarks.md`, which includes `benchmarks/README.md`.
"""

from __future__ import annotations

import ast
import os

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tf_distbelief"
REFERENCE = "reference.md"  # The hand-written index; the list is appended.


def _resolve(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of a `from ... import` inside `package`'s `__init__`."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return None


def _lazy_mapping(tree: ast.Module) -> dict[str, str] | None:
    """`{name: module}` of an `_lazy.exports(__name__, {...})` call, if any."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "exports"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Dict)
        ):
            return ast.literal_eval(node.args[1])
    return None


def public_names(package: str, init_path: str) -> tuple[str, dict[str, str]]:
    """`(docstring, {public name: dotted path of its definition})`."""
    with open(init_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), init_path)
    doc = ast.get_docstring(tree) or ""
    lazy = _lazy_mapping(tree)
    if lazy is not None:
        return doc, {n: f"{package}.{m}.{n}" for n, m in sorted(lazy.items())}
    exported = _literal_all(tree) or []
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = _resolve(package, node)
            for alias in node.names:
                name = alias.asname or alias.name
                if name in exported:
                    found[name] = f"{module}.{alias.name}"
    return doc, dict(sorted(found.items()))


def packages() -> list[tuple[str, str, dict[str, str]]]:
    """`(package, docstring, names)` for every public package with exports."""
    out = []
    top = os.path.join(ROOT, PACKAGE)
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        if "__init__.py" not in files:
            dirs[:] = []
            continue
        rel = os.path.relpath(folder, ROOT)
        package = rel.replace(os.sep, ".")
        doc, names = public_names(package, os.path.join(folder, "__init__.py"))
        if names:
            out.append((package, doc, names))
    return out


def _page_uri(package: str) -> str:
    short = package.split(".", 1)[1] if "." in package else package
    return f"reference/{short}.md"


def _summary(doc: str) -> str:
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def owners() -> dict[str, str]:
    """Each definition's page: the deepest package exporting it that holds it.

    A name exported by several packages (the top level re-exports many) is
    rendered once, so that every object has one anchor.
    """
    owner: dict[str, str] = {}
    for package, _, names in packages():
        for path in names.values():
            best = owner.get(path)
            inside = path.startswith(package + ".")
            if best is None or (inside and len(package) > len(best)):
                owner[path] = package
    return owner


def _page(package: str, doc: str, names: dict[str, str], owner) -> str:
    lines = [f"# `{package}`", "", _summary(doc), ""]
    lines += [f"Import the names from the package: `from {package} import NAME`.", ""]
    elsewhere = {n: p for n, p in names.items() if owner[p] != package}
    if elsewhere:
        lines += ["Documented on their own package's page:", ""]
        for name, path in elsewhere.items():
            page = os.path.basename(_page_uri(owner[path]))
            lines.append(f"- [`{name}`]({page}#{path})")
        lines.append("")
    for name, path in names.items():
        if name not in elsewhere:
            lines += [f"::: {path}", ""]
    return "\n".join(lines)


def on_config(config):
    """Adds one reference page per package to the nav (under 'API reference')."""
    pages = [{"Overview": REFERENCE}]
    pages += [{package: _page_uri(package)} for package, _, _ in packages()]
    for i, entry in enumerate(config["nav"] or []):
        if isinstance(entry, dict) and "API reference" in entry:
            config["nav"][i] = {"API reference": pages}
    return config


def on_files(files, config):
    owner = owners()
    for package, doc, names in packages():
        content = _page(package, doc, names, owner)
        files.append(File.generated(config, _page_uri(package), content=content))
    results = os.path.join(ROOT, "benchmarks", "results")
    for name in sorted(os.listdir(results)):
        if name.endswith(".png"):
            files.append(
                File.generated(
                    config,
                    f"results/{name}",
                    abs_src_path=os.path.join(results, name),
                )
            )
    return files


def on_page_markdown(markdown, page, config, files):
    """Appends to the reference overview a table of the packages and names."""
    if page.file.src_uri != REFERENCE:
        return markdown
    rows = ["| package | public names |", "| --- | --- |"]
    for package, _, names in packages():
        link = os.path.relpath(_page_uri(package), os.path.dirname(REFERENCE) or ".")
        listed = ", ".join(f"`{n}`" for n in names)
        rows.append(f"| [`{package}`]({link}) | {listed} |")
    return markdown.rstrip("\n") + "\n\n" + "\n".join(rows) + "\n"
