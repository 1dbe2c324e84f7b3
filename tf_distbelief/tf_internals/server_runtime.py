"""A ps or worker task's TensorFlow: its C++ runtime and `tf.distribute.Server`,
without building TensorFlow's Python API.

A ps or worker task runs no TensorFlow Python code of its own: the chief sends
it functions and ops, and the task's C++ runtime executes them. Yet
`import tensorflow` builds the whole Python API first (autograph, tf.data's
experimental ops, the distribute strategies and their test combinations, the
v1 compatibility tree, Keras's optimizers): about 3.5 to 4.5 s of CPU time a
process on the 2-core machines this package is developed on, against about
0.6 s for the modules a server uses (the runtime library, `server_lib`, the
`ConfigProto` message, `errors`). The local cluster starts one such process
per task on every start of the chief and on every task restart, all at once,
so on 2 cores a chief's start waited about 6 s longer for its 4 tasks' imports
than their servers need.

Internal relied on: Python runs a package's `__init__` before any of its
submodules, unless the package's module is already in `sys.modules`.
`load(lean=True)` places a bare module for the `tensorflow` package there
(its `__path__` and spec, none of its `__init__`) and imports
`tensorflow.python.training.server_lib` (`tf.distribute.Server`,
`tf.train.ClusterSpec`), `tensorflow.core.protobuf.config_pb2`
(`tf.compat.v1.ConfigProto`) and `tensorflow.python.framework.errors`
(`tf.errors`). Public route checked: none; `tf.distribute.Server` is reached
only through `import tensorflow`.

What `tensorflow/__init__.py` does besides building the API, and how it is
kept: it loads kernel libraries from `tensorflow/core/kernels` and from
`tensorflow-plugins` folders on the path, the pluggable device library of
`TF_PLUGGABLE_DEVICE_LIBRARY_PATH`, and the modular file systems of
`TF_USE_MODULAR_FILESYSTEM`; where any of these is present, `load` imports
TensorFlow whole (`lean_possible`). It enables TF2 behaviour, which only
Python graph building reads.

After a lean load, `import tensorflow` in the same process gives the bare
module: only a process that runs nothing but its server (`server_main`) asks
for it, before anything imports TensorFlow.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import NamedTuple

__all__ = ["ServerRuntime", "check", "lean_possible", "load"]

# What `tensorflow/__init__.py` loads besides the Python API (module docstring).
_PLUGIN_ENV = ("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "TF_USE_MODULAR_FILESYSTEM")
_PLUGIN_FOLDER = "tensorflow-plugins"
# Marks the bare `tensorflow` module of a lean load.
_LEAN_MARK = "_tf_distbelief_lean_server"


class ServerRuntime(NamedTuple):
    """What a ps or worker task's server uses of TensorFlow.

    Attributes:
      Server: `tf.distribute.Server`.
      ClusterSpec: `tf.train.ClusterSpec`.
      ConfigProto: `tf.compat.v1.ConfigProto`.
      UnknownError: `tf.errors.UnknownError` (what a server that cannot listen
        on its port raises).
      lean: whether TensorFlow's Python API was left unbuilt.
    """

    Server: type
    ClusterSpec: type
    ConfigProto: type
    UnknownError: type
    lean: bool


def lean_possible() -> bool:
    """Whether a lean load would load everything `import tensorflow` loads
    into the runtime: no plugin folder, no plugin environment variable, and
    TensorFlow not imported yet."""
    if "tensorflow" in sys.modules:
        return False
    if any(os.environ.get(name, "").strip() for name in _PLUGIN_ENV):
        return False
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = list(spec.submodule_search_locations)[0]
    if os.path.isdir(os.path.join(package, "core", "kernels")):
        return False
    for folder in sys.path:
        if os.path.isdir(os.path.join(folder, _PLUGIN_FOLDER)):
            return False
    return True


def load(lean: bool = False) -> ServerRuntime:
    """Imports what a ps or worker server uses of TensorFlow.

    Args:
      lean: leave TensorFlow's Python API unbuilt where `lean_possible()`
        (module docstring); otherwise, or when False, `import tensorflow`.

    Returns:
      A `ServerRuntime`.
    """
    if lean and lean_possible():
        spec = importlib.util.find_spec("tensorflow")
        package = types.ModuleType("tensorflow")
        package.__spec__ = spec
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        setattr(package, _LEAN_MARK, True)
        sys.modules["tensorflow"] = package
        return _from_modules()
    import tensorflow as tf

    if getattr(tf, _LEAN_MARK, False):  # Loaded lean before.
        return _from_modules()
    return ServerRuntime(
        tf.distribute.Server,
        tf.train.ClusterSpec,
        tf.compat.v1.ConfigProto,
        tf.errors.UnknownError,
        lean=False,
    )


def _from_modules() -> ServerRuntime:
    """The runtime from the modules a lean load imports (module docstring)."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.framework import errors
    from tensorflow.python.training import server_lib

    return ServerRuntime(
        server_lib.Server,
        server_lib.ClusterSpec,
        config_pb2.ConfigProto,
        errors.UnknownError,
        lean=True,
    )


def check() -> None:
    """Fails if the modules a lean load imports no longer hold what it takes
    from them (checked in this process's full TensorFlow: the same modules)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.framework import errors
    from tensorflow.python.training import server_lib

    pairs = (
        (server_lib.Server, tf.distribute.Server),
        (server_lib.ClusterSpec, tf.train.ClusterSpec),
        (config_pb2.ConfigProto, tf.compat.v1.ConfigProto),
        (errors.UnknownError, tf.errors.UnknownError),
    )
    for internal, public in pairs:
        if internal is not public:
            raise AssertionError(
                f"TensorFlow {tf.__version__}: {internal!r} is no longer "
                f"{public!r}; tf_internals.server_runtime needs updating."
            )
