"""Helpers of the modules' `check()`s: names code uses, and the failure message."""

from __future__ import annotations

import types

import tensorflow as tf


def code_names(function) -> set[str]:
    """Attribute and global names `function`'s code uses, nested functions too."""
    names, stack = set(), [getattr(function, "__wrapped__", function).__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def source_names(cls: type) -> set[str]:
    """Attribute names the methods of `cls` use (from their code objects)."""
    names = set()
    for attr in vars(cls).values():
        code = getattr(getattr(attr, "__wrapped__", attr), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def expect(module: str, expectations: list[tuple[str, bool]]) -> None:
    """Raises AssertionError naming each internal of `expectations` not true.

    Args:
      module: the `tf_internals` module the internals are used through.
      expectations: `(internal, still has the shape relied on)` pairs.
    """
    missing = [name for name, ok in expectations if not ok]
    # Imported here, for the message only: the `tf_internals` modules that
    # Keras 3 training uses (`variables`, `coordinator`, ...) import no tf_keras.
    import tf_keras

    versions = f"TensorFlow {tf.__version__}, tf_keras {tf_keras.__version__}"
    assert not missing, (
        f"TensorFlow internals that tf_distbelief relies on changed shape in "
        f"{versions}: {', '.join(missing)}. See tf_distbelief/tf_internals/"
        f"{module}.py."
    )
