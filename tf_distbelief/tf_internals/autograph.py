"""The source files autograph writes for the functions it converts.

Autograph writes each converted function's source to a temporary file
(`__autograph_generated_file*.py` in the temporary folder) and removes it at
interpreter exit (`atexit`). A process that ends through `os._exit` (the
launch scripts, a stopped job) skips that, and left a handful of files per
job behind. `remove_generated_files` removes them first. Public route
checked: none; `tf.autograph` has no cleanup call.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

# The prefix autograph gives its files and modules (`pyct.loader.load_source`).
_PREFIX = "__autograph_generated_file"


def remove_generated_files() -> int:
    """Removes this process's autograph source files; returns how many.

    Only files in the temporary folder whose module this process loaded, so
    another process's are never touched. Imports no TensorFlow.
    """
    folder = os.path.realpath(tempfile.gettempdir())
    removed = 0
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not (name.startswith(_PREFIX) and path):
            continue
        if os.path.dirname(os.path.realpath(path)) != folder:
            continue
        with contextlib.suppress(OSError):
            os.remove(path)
            removed += 1
    return removed


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    from tensorflow.python.autograph.pyct import loader

    from tf_distbelief.tf_internals import _shapes

    _shapes.expect(
        "autograph",
        [
            (
                "autograph's loader writes __autograph_generated_file* modules",
                _PREFIX in loader.load_source.__code__.co_consts,
            ),
        ],
    )
