"""Reading a variable as another tensor while a model is traced.

Two parts of tf_distbelief run a model's own code at values that are not its
variables': Downpour (Dean et al. 2012, section 4.1) at a replica's cached
parameters, and Sandblaster L-BFGS (section 4.2) at a slice of the
coordinator's flat parameter vector. Both trace the model inside
`substitute(pairs)`: there each variable of `pairs` reads as the tensor it is
paired with, so a `tf.GradientTape` watching those tensors differentiates with
respect to them, and the variables themselves are never read.

Only variables of a class with the `Substitutable` mixin are redirected:
`downpour.variables.DownpourVariable` has it; plain `tf.Variable`s get it for
the length of a `substitutable(variables)` block (their class is swapped for a
subclass with the mixin and back, `tf_internals.variables.swap_class`; the
mixin adds no state).

A variable paired with a `RowSource` (Downpour's row-sparse tables) reads rows
on demand: its row lookups (`sparse_read`, which `tf.nn.embedding_lookup` and
`tf.gather` use) call `RowSource.read_rows`, and a whole read raises the
error `RowSource.whole_read_error` gives.

Only reads traced in the thread that entered the block are redirected, and
only reads that go through Python: trace the model in a `tf.function` (in
eager mode TensorFlow's fast path reads a variable passed to an op by its
handle, past the mixin).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterable, Iterator

import tensorflow as tf

from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["RowSource", "Substitutable", "substitutable", "substitute"]

_local = threading.local()


def _substitution(variable):
    """The tensor or `RowSource` `variable` reads as, or None."""
    return getattr(_local, "values", {}).get(id(variable))


class RowSource(abc.ABC):
    """What a variable reads as under `substitute`: its rows, on demand."""

    @abc.abstractmethod
    def read_rows(self, indices: tf.Tensor) -> tf.Tensor:
        """Returns `[*indices.shape, *row_shape]`: the rows at `indices`.

        Args:
          indices: int32 or int64 row indices of the variable (a shard's own
            rows for a shard), any shape.
        """

    def whole_read_error(self, variable) -> Exception:
        """The error raised when `variable`, paired with this source, is read
        whole (its value, a conversion to a tensor, `gather_nd`)."""
        return RuntimeError(
            f"Variable {variable.name} reads by rows only here, but it was read whole."
        )


@contextlib.contextmanager
def substitute(pairs: Iterable[tuple[object, tf.Tensor | RowSource]]) -> Iterator:
    """Within the block, each variable in `pairs` reads as its tensor.

    Args:
      pairs: `(variable, tensor or RowSource)` pairs; the variable's class has
        the `Substitutable` mixin, the tensor its shape and dtype.
    """
    previous = getattr(_local, "values", {})
    _local.values = {**previous, **{id(v): t for v, t in pairs}}
    try:
        yield
    finally:
        _local.values = previous


class Substitutable:
    """Mixin for resource variable classes: reads follow `substitute`.

    Overrides every read of `BaseResourceVariable` and of tf.distribute's
    `CachingVariable`: `value`, `read_value`, `_read_variable_op` (which the
    reads of a plain `ResourceVariable` go through), the conversion to a
    tensor, `sparse_read` and `gather_nd`. Outside `substitute`, or for a
    variable not in its pairs, each reads the variable as usual.
    """

    def _substitute(self):
        value = _substitution(self)
        if isinstance(value, RowSource):
            raise value.whole_read_error(self)
        return value

    def _read_variable_op(self, *args, **kwargs):
        value = self._substitute()
        if value is None:
            return super()._read_variable_op(*args, **kwargs)
        return value

    def value(self):
        value = self._substitute()
        return super().value() if value is None else value

    def read_value(self):
        value = self._substitute()
        return super().read_value() if value is None else value

    def sparse_read(self, indices, name=None):
        source = _substitution(self)
        if isinstance(source, RowSource):
            return source.read_rows(indices)
        if source is None:
            return super().sparse_read(indices, name=name)
        return tf.gather(source, indices, name=name)

    def gather_nd(self, indices, name=None):
        value = self._substitute()
        if value is None:
            return super().gather_nd(indices, name=name)
        return tf.gather_nd(value, indices, name=name)

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = self._substitute()
        if value is None:
            return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
        if dtype is not None and not dtype.is_compatible_with(value.dtype):
            raise ValueError(
                f"Variable {self.name} of dtype {value.dtype.name} was requested "
                f"as {dtype.name}."
            )
        return value


_SUBSTITUTABLE_CLASSES: dict[type, type] = {}


def _substitutable_class(cls: type) -> type:
    if cls not in _SUBSTITUTABLE_CLASSES:
        _SUBSTITUTABLE_CLASSES[cls] = type(
            f"Substitutable{cls.__name__}", (Substitutable, cls), {}
        )
    return _SUBSTITUTABLE_CLASSES[cls]


@contextlib.contextmanager
def substitutable(variables: Iterable[tf.Variable]) -> Iterator:
    """Within the block, `variables` have the `Substitutable` mixin.

    For variables created by code that knows nothing of substitution (a
    tf_keras model's weights): each one's class is swapped for a subclass with
    the mixin, and restored on exit. Variables that have the mixin already are
    left as they are.

    Args:
      variables: resource variables (`tf.Variable`s of one process).
    """
    swapped = []
    try:
        for v in variables:
            if not isinstance(v, Substitutable):
                swapped.append((v, type(v)))
                tf_variables.swap_class(v, _substitutable_class(type(v)))
        yield
    finally:
        for v, cls in swapped:
            tf_variables.swap_class(v, cls)
