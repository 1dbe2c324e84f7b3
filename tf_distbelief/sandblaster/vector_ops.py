"""The vector space L-BFGS runs in, with the storage abstracted away.

Sandblaster L-BFGS (Dean et al. 2012, section 4.2) runs the L-BFGS loop on a
coordinator that never holds the parameters: it issues a small set of vector
operations (dot product, scaling, axpy, element-wise add and multiply, copy)
that every parameter-server shard performs on its own slice, and it keeps only
python scalars.

* `VectorOps` is that interface. Vectors are opaque handles owned by the
  backend; every operation either returns a python `float` (`dot`) or
  overwrites a vector in place.
* `NumpyVectorOps` is the single-process backend (1-D NumPy arrays), the
  reference the sharded backend (`sandblaster.ps_vectors`) is tested against.

Two batched operations serve vector-free L-BFGS (Chen, Wang and Zhou, NIPS
2014; `sandblaster.two_loop`): `combine` forms a linear combination of many
vectors and `gram` returns a matrix of dot products, each in one call (one
round trip to the ps in Sandblaster) where the primitives need one call per
vector. Their defaults here are built from the primitives; a backend whose
calls are remote overrides them.
"""

import abc
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from tf_distbelief import checks

__all__ = ["NumpyVectorOps", "Vector", "VectorOps", "check_combination"]

# A backend's vector handle: a 1-D NumPy array, a `ps_vectors.PsVector`, ...
Vector = TypeVar("Vector")


class VectorOps(abc.ABC, Generic[Vector]):
    """Vector-space operations that L-BFGS needs, on vectors the backend owns.

    The algorithm never looks inside a vector. All in-place operations follow the
    BLAS convention: the last vector argument is overwritten, the others are read.
    Only `dot` returns data to the caller, and only a python `float`, so a backend
    that shards vectors over parameter servers moves one scalar per shard and
    operation (Dean et al. 2012, section 4.2).

    `from_numpy` and `to_numpy` move whole vectors and are meant for the initial
    point, results and tests, not for the inner loop.
    """

    @abc.abstractmethod
    def from_numpy(self, array: np.ndarray) -> Vector:
        """Returns a new vector holding the values of the 1-D `array`."""

    @abc.abstractmethod
    def to_numpy(self, x: Vector) -> np.ndarray:
        """Returns the values of `x` as a 1-D NumPy array."""

    @abc.abstractmethod
    def zeros_like(self, x: Vector) -> Vector:
        """Returns a new vector of zeros shaped and placed like `x`."""

    @abc.abstractmethod
    def copy(self, x: Vector) -> Vector:
        """Returns a new vector holding the values of `x`."""

    @abc.abstractmethod
    def assign(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x`."""

    @abc.abstractmethod
    def dot(self, x: Vector, y: Vector) -> float:
        """Returns the inner product `x·y` as a python float."""

    @abc.abstractmethod
    def scale(self, alpha: float, x: Vector) -> None:
        """Sets `x <- alpha * x`."""

    @abc.abstractmethod
    def axpy(self, alpha: float, x: Vector, y: Vector) -> None:
        """Sets `y <- alpha * x + y`."""

    @abc.abstractmethod
    def add(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x + y` element-wise."""

    @abc.abstractmethod
    def multiply(self, x: Vector, y: Vector) -> None:
        """Sets `y <- x * y` element-wise."""

    def combine(
        self, coefficients: Sequence[float], vectors: Sequence[Vector], out: Vector
    ) -> None:
        """Sets `out <- sum_j coefficients[j] * vectors[j]`, summed in order.

        One call for the whole combination (vector-free L-BFGS forms its
        direction from `2 m + 1` vectors this way). The default is `assign`,
        `scale` and one `axpy` per further vector.

        Args:
          coefficients: `k >= 1` floats.
          vectors: `k` vectors laid out alike; `out` must not be one of them.
          out: the vector overwritten.

        Raises:
          ValueError: `coefficients` and `vectors` differ in length, or are empty.
        """
        check_combination(coefficients, vectors)
        self.assign(vectors[0], out)
        if coefficients[0] != 1.0:
            self.scale(float(coefficients[0]), out)
        for alpha, x in zip(coefficients[1:], vectors[1:]):
            self.axpy(float(alpha), x, out)

    def gram(
        self,
        rows: Sequence[Vector],
        columns: Sequence[Vector],
        updates: Sequence[tuple[Sequence[float], Sequence[Vector], Vector]] = (),
    ) -> np.ndarray:
        """Applies `updates`, then returns the dot products `rows[i]·columns[j]`.

        One call for the whole matrix and the updates before it: vector-free
        L-BFGS forms its new `(s, y)` pair and reads every new dot product it
        needs in one round trip.

        Args:
          rows: `r` vectors.
          columns: `c` vectors laid out like `rows`.
          updates: `(coefficients, vectors, out)` triples applied first, in
            order, each as `combine(coefficients, vectors, out)`.

        Returns:
          `[r, c]` float64 NumPy array. The default calls `dot` per entry.
        """
        for coefficients, vectors, out in updates:
            self.combine(coefficients, vectors, out)
        return np.array(
            [[self.dot(x, y) for y in columns] for x in rows], dtype=np.float64
        ).reshape(len(rows), len(columns))


class NumpyVectorOps(VectorOps[np.ndarray]):
    """`VectorOps` on 1-D NumPy arrays in one process.

    Args:
      dtype: floating dtype of the vectors. Defaults to float64, the precision
        L-BFGS tests are written for.

    Raises:
      TypeError: if `dtype` is not a floating dtype.
    """

    def __init__(self, dtype: Any = np.float64):
        dtype = np.dtype(dtype)
        if not np.issubdtype(dtype, np.floating):
            raise checks.argument_error("dtype", "a floating dtype", dtype)
        self._dtype = dtype

    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        """Returns a copy of the 1-D `array` in this backend's dtype.

        Raises:
          ValueError: if `array` is not 1-D.
        """
        array = np.asarray(array)
        if array.ndim != 1:
            raise checks.argument_error(
                "array",
                "1-D; flatten parameters into one vector",
                array.shape,
                what="shape",
            )
        return np.array(array, dtype=self._dtype)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def zeros_like(self, x: np.ndarray) -> np.ndarray:
        return np.zeros_like(x)

    def copy(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def assign(self, x: np.ndarray, y: np.ndarray) -> None:
        y[...] = x

    def dot(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.dot(x, y))

    def scale(self, alpha: float, x: np.ndarray) -> None:
        x *= alpha

    def axpy(self, alpha: float, x: np.ndarray, y: np.ndarray) -> None:
        y += alpha * x

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        y += x

    def multiply(self, x: np.ndarray, y: np.ndarray) -> None:
        y *= x

    def combine(
        self,
        coefficients: Sequence[float],
        vectors: Sequence[np.ndarray],
        out: np.ndarray,
    ) -> None:
        check_combination(coefficients, vectors)
        total = coefficients[0] * vectors[0]
        for alpha, x in zip(coefficients[1:], vectors[1:]):
            total += alpha * x
        out[...] = total


def check_combination(coefficients, vectors) -> None:
    """Raises unless `combine(coefficients, vectors, ...)` is well formed.

    Raises:
      ValueError: the two differ in length, or are empty.
    """
    if len(coefficients) != len(vectors) or not vectors:
        raise checks.argument_error(
            "vectors",
            "non-empty, with `coefficients` of the same length",
            vectors,
            shown=f"{len(coefficients)}, {len(vectors)}",
            what="lengths",
        )
