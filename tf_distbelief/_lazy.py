"""Lazy re-exports for package `__init__` modules (PEP 562).

A package re-exports its public names without importing their modules until
one is used, so that importing a pure module (a schedule, a NumPy reference,
the L-BFGS math, the partition arithmetic) never imports TensorFlow through
its package's `__init__`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def exports(
    package: str, names: Mapping[str, str], packages: tuple[str, ...] = ()
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """Returns `(__all__, __getattr__, __dir__)` for `package`'s `__init__`.

    Args:
      package: the package's `__name__`.
      names: public name -> the module (relative to `package`) that defines it.
      packages: subpackages imported on first use as attributes
        (`tf_distbelief.downpour` after `import tf_distbelief`); listed by
        `__dir__`, not in `__all__`.

    Returns:
      The sorted public names, a module-level `__getattr__` that imports a
      name's module on first use, and a `__dir__` listing the public names.

    Raises:
      AttributeError (from `__getattr__`): a name the package does not export.
    """

    def __getattr__(name: str):
        if name in packages:
            return importlib.import_module(f"{package}.{name}")
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{names[name]}")
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted([*names, *packages])

    return sorted(names), __getattr__, __dir__
