"""A tf_keras model's trainable weights as one flat float64 vector.

Sandblaster L-BFGS (Dean et al. 2012, section 4.2) optimises one parameter
vector that lives sharded on the parameter servers (`sandblaster.ps_vectors`),
while the model is ordinary tf_keras code. This module maps between the two:

* `FlatLayout` records each weight's shape, dtype and offset in the vector,
  `[w_0.ravel(), w_1.ravel(), ...]` in `model.trainable_weights` order, and
  converts NumPy weights to and from the vector.
* `evaluate_at(layout, params)` is a context manager under which the model's
  weights read as slices of the tensor `params` instead of their variables, so a
  `tf.function` traced inside it computes the model at `params`, differentiable
  with respect to `params`, and never touches the weight variables. Every
  worker can then evaluate the model at the coordinator's current point without
  any variable of its own being written.

Example:

```python
layout = flat_params.FlatLayout(model)
x0 = layout.flatten(model.get_weights())        # `[layout.size]` float64

@tf.function
def loss_at(params):
    with flat_params.evaluate_at(layout, params):
        return tf.reduce_sum(model(features))
```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from tf_distbelief import checks, substitution
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["FlatLayout", "evaluate_at"]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each trainable weight of a model sits in the flat parameter vector.

    Args:
      model: a built tf_keras model whose trainable weights are plain
        `tf.Variable`s (built outside any distribution strategy's scope:
        Sandblaster keeps the parameters on the ps itself, and the model only
        defines the function and receives the trained weights).

    Attributes:
      variables: the model's trainable variables, in vector order.
      shapes: each variable's shape.
      dtypes: each variable's dtype (the vector itself is float64).
      offsets: start of each variable in the vector, then the vector size.

    Raises:
      ValueError: the model is not built or has no trainable weights.
      TypeError: a weight is not a plain `tf.Variable` (e.g. one created under
        `strategy.scope()`).
    """

    variables: tuple
    shapes: tuple
    dtypes: tuple
    offsets: tuple

    def __init__(self, model):
        if not getattr(model, "built", False):
            raise checks.argument_error(
                "model",
                "built (give it an input shape or call it once) before its weights "
                "can be laid out",
                model.name,
            )
        variables = tuple(model.trainable_weights)
        if not variables:
            raise ValueError(
                "Argument `model` must have trainable weights. Received: "
                f"{model.name!r}"
            )
        for v in variables:
            if not isinstance(v, tf_variables.ResourceVariable):
                raise checks.argument_error(
                    "model",
                    "built outside any distribution strategy's scope: Sandblaster "
                    "keeps the parameters on the ps itself",
                    v.name,
                    described=f"weight {v.name!r} of type {type(v).__name__}",
                )
        sizes = [int(np.prod(v.shape)) for v in variables]
        object.__setattr__(self, "variables", variables)
        object.__setattr__(self, "shapes", tuple(tuple(v.shape) for v in variables))
        object.__setattr__(self, "dtypes", tuple(v.dtype for v in variables))
        object.__setattr__(
            self, "offsets", tuple(np.concatenate([[0], np.cumsum(sizes)]).tolist())
        )

    @property
    def size(self) -> int:
        """Number of elements of the flat vector."""
        return self.offsets[-1]

    def flatten(self, weights) -> np.ndarray:
        """Returns `[size]` float64: the arrays `weights` (in layout order) raveled."""
        return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])

    def unflatten(self, vector: np.ndarray) -> list[np.ndarray]:
        """Returns the weight arrays held in the `[size]` `vector`, in their dtypes."""
        return [
            np.asarray(vector[a:b]).reshape(shape).astype(dtype.as_numpy_dtype)
            for a, b, shape, dtype in zip(
                self.offsets[:-1], self.offsets[1:], self.shapes, self.dtypes
            )
        ]

    def read(self) -> np.ndarray:
        """Returns the model's current weights as a `[size]` float64 vector."""
        return self.flatten([v.numpy() for v in self.variables])

    def write(self, vector: np.ndarray) -> None:
        """Assigns the `[size]` `vector` to the model's weights."""
        for v, value in zip(self.variables, self.unflatten(vector)):
            v.assign(value)

    def pieces(self, params: tf.Tensor) -> list[tf.Tensor]:
        """Slices of the `[size]` tensor `params`, reshaped and cast per weight."""
        return [
            tf.cast(tf.reshape(params[a:b], shape), dtype)
            for a, b, shape, dtype in zip(
                self.offsets[:-1], self.offsets[1:], self.shapes, self.dtypes
            )
        ]


@contextlib.contextmanager
def evaluate_at(layout: FlatLayout, params: tf.Tensor) -> Iterator:
    """Within the block, the model's trainable weights read as slices of `params`.

    Meant for tracing a `tf.function`: the traced graph computes the model at
    `params` (a `[layout.size]` tensor) and does not capture the weight
    variables. Gradients with respect to `params` flow through the slices.
    The weights read so through `tf_distbelief.substitution`, the mechanism
    Downpour reads its caches with.

    Args:
      layout: the model's `FlatLayout`.
      params: `[layout.size]` tensor, any floating dtype (cast per weight).
    """
    pairs = list(zip(layout.variables, layout.pieces(params)))
    with substitution.substitutable(layout.variables):
        with substitution.substitute(pairs):
            yield
