"""L-BFGS vectors sharded over parameter-server tasks (Dean et al. 2012, §4.2).

In Sandblaster L-BFGS the coordinator "never holds the parameters": it issues
vector operations that every parameter-server shard performs on its own slice,
and a dot product is the sum of the shards' partial dot products. `PsVectorOps`
is that backend (a `vector_ops.VectorOps`) for `sandblaster.lbfgs`: a vector is
a `PsVector`, a float64 vector cut into contiguous shards, each a `tf.Variable`
on a `ps` task; every operation is one `tf.function` call whose per-shard ops
are pinned to the shard's own device, and only python floats (`dot`) come back
to the coordinator.

Example, in a process connected to a cluster by a parameter-server strategy:

```python
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
ops = ps_vectors.PsVectorOps(strategy)
x0 = ops.from_numpy(np.zeros(1000))     # one shard per ps task
result = lbfgs.minimize(fun_and_grad, x0, ops, m=10)
```

`fun_and_grad(x)` reads `x.shards` (on workers, say) and returns the loss and a
`PsVector` gradient laid out like `x` (`ops.zeros_like(x)` once, then written in
place).
"""

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.sandblaster import ps_batched, vector_ops

__all__ = ["PsVector", "PsVectorOps", "shard_sizes"]

_DTYPE = tf.float64
_PS_JOB = "/job:ps/"


def shard_sizes(size: int, num_shards: int) -> list[int]:
    """Sizes of the contiguous shards of a `size`-element vector.

    The "div" layout of `ParameterServerStrategy` partitioning: the first
    `size % num_shards` shards hold one element more. A vector shorter than
    `num_shards` gets `size` shards of one element (no empty shards).

    Args:
      size: number of elements, >= 1.
      num_shards: requested number of shards, >= 1.

    Returns:
      `min(size, num_shards)` positive ints summing to `size`.
    """
    num_shards = min(size, num_shards)
    base, extra = divmod(size, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


@dataclasses.dataclass(frozen=True, eq=False)
class PsVector:
    """A float64 vector held as contiguous shards on parameter-server tasks.

    Attributes:
      shards: 1-D float64 `tf.Variable`s, in vector order; shard `i` holds
        elements `offsets[i]:offsets[i + 1]`.
    """

    shards: tuple[tf.Variable, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each shard."""
        return tuple(int(s.shape[0]) for s in self.shards)

    @property
    def size(self) -> int:
        """Number of elements of the vector."""
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each shard in the vector, then the vector size."""
        return tuple(np.concatenate([[0], np.cumsum(self.sizes)]).tolist())

    @property
    def devices(self) -> tuple[str, ...]:
        """Device of each shard, e.g. `/job:ps/replica:0/task:1/device:CPU:0`."""
        return tuple(s.device for s in self.shards)


# The operations are shared by every `PsVectorOps`. Each takes the output
# shards' devices as a python argument, so they are part of the trace key:
# variables are traced by shape and dtype only, while the device pins are baked
# into the graph.


def _elementwise(update):
    @tf.function(autograph=False)
    def run(devices, alpha, xs, ys):
        for device, x, y in zip(devices, xs, ys):
            with tf.device(device):
                update(alpha, x, y)

    return run


_ELEMENTWISE = {
    "assign": _elementwise(lambda a, x, y: y.assign(x)),
    "scale": _elementwise(lambda a, x, y: y.assign(a * y)),
    "axpy": _elementwise(lambda a, x, y: y.assign_add(a * x)),
    "add": _elementwise(lambda a, x, y: y.assign_add(x)),
    "multiply": _elementwise(lambda a, x, y: y.assign(x * y)),
}


@tf.function(autograph=False)
def _dot(coordinator_device, devices, xs, ys):
    partials = []
    for device, x, y in zip(devices, xs, ys):
        with tf.device(device):
            partials.append(tf.reduce_sum(x * y))
    with tf.device(coordinator_device):
        return tf.add_n(partials)


class PsVectorOps(vector_ops.VectorOps[PsVector]):
    """`vector_ops.VectorOps` on vectors sharded over the ps tasks of a cluster.

    Layout: `from_numpy` cuts a vector into `num_shards` contiguous shards
    (`shard_sizes`) and puts shard `i` on ps task `i % num_ps`; `copy` and
    `zeros_like` place every shard next to the matching shard of their argument.
    So all the vectors `lbfgs.minimize` creates from `x0` share `x0`'s layout and
    every element-wise operation stays on its shard's ps task.

    The strategy's own partitioner is deliberately not used for new vectors: it
    places shards round-robin with a counter shared by every variable of the
    strategy, so shard `i` of two vectors can land on different ps tasks (and a
    `MinSizePartitioner` keeps small vectors whole). A vector the strategy did
    create, such as model parameters, can still join through `wrap`.

    Cost per operation: one `tf.function` call on the coordinator, whose ops run
    on the shards' devices. The coordinator sends each shard only the python
    scalars (`alpha`) and receives only one float from `dot`, the sum of the
    shards' partial dot products computed on the coordinator's device. Vectors
    are moved whole only by `from_numpy` and `to_numpy`. `combine` and `gram`
    (vector-free L-BFGS, `sandblaster.two_loop`) do the work of many
    operations in one call: each shard forms its slice of a linear
    combination, or computes its `[r, c]` block of partial dot products with
    one matmul, and only that block comes back.

    Args:
      strategy: a `tf.distribute.experimental.ParameterServerStrategy` (or a
        subclass such as `tf_distbelief.strategy.DistBeliefStrategy`); creating it
        connected this process to the cluster, whose ps tasks hold the shards.
      num_shards: shards of each vector made by `from_numpy`; None means one per
        ps task.

    Attributes:
      num_shards: shards of each vector `from_numpy` makes.
      coordinator_device: where the partial dot products are summed.
      round_trips: `collections.Counter` of the calls made so far by operation
        name (`"dot"`, `"axpy"`, `"combine"`, `"gram"`, `"zeros_like"`, ...):
        each is one `tf.function` call from the coordinator to the ps tasks
        and back. For tests and benchmarks; clear it freely.

    Raises:
      TypeError: if `strategy` is not a ParameterServerStrategy or `num_shards` is
        not an int.
      ValueError: if `num_shards` is not positive, or this process sees no ps
        device.
    """

    def __init__(
        self,
        strategy: tf.distribute.experimental.ParameterServerStrategy,
        num_shards: int | None = None,
    ):
        if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise checks.argument_error(
                "strategy",
                "a tf.distribute.experimental.ParameterServerStrategy",
                strategy,
                shown=type(strategy).__name__,
            )
        # ParameterServerStrategy has no public list of ps tasks; after it has
        # connected this process to the cluster they are logical devices here.
        self._ps_devices = sorted(
            (
                d.name
                for d in tf.config.list_logical_devices("CPU")
                if _PS_JOB in d.name
            ),
            key=lambda name: int(name.split("/task:")[1].split("/")[0]),
        )
        if not self._ps_devices:
            raise ValueError(
                "This process sees no ps device; create the ParameterServerStrategy "
                "(which connects to the cluster) before `PsVectorOps`."
            )
        if num_shards is None:
            num_shards = len(self._ps_devices)
        if not checks.is_int(num_shards):
            raise checks.argument_error("num_shards", "an int or None", num_shards)
        if num_shards < 1:
            raise checks.argument_error("num_shards", "positive", num_shards)
        self.num_shards = num_shards
        # Eager tensors are created on the coordinator's own device.
        self.coordinator_device = tf.constant(0.0).device
        self.round_trips: collections.Counter = collections.Counter()

    @property
    def ps_devices(self) -> tuple[str, ...]:
        """The ps devices, by task index."""
        return tuple(self._ps_devices)

    # ------------------------------------------------------------- creation

    def from_numpy(self, array: np.ndarray) -> PsVector:
        """Returns a new vector holding the 1-D `array`, sharded over the ps tasks.

        Raises:
          ValueError: if `array` is not 1-D or is empty.
        """
        array = np.asarray(array, dtype=np.float64)
        if array.ndim != 1 or array.size == 0:
            raise checks.argument_error(
                "array",
                "1-D and non-empty; flatten parameters into one vector",
                array.shape,
                what="shape",
            )
        self.round_trips["from_numpy"] += 1
        shards, start = [], 0
        for i, size in enumerate(shard_sizes(array.size, self.num_shards)):
            with tf.device(self._ps_devices[i % len(self._ps_devices)]):
                shards.append(tf.Variable(array[start : start + size], trainable=False))
            start += size
        return PsVector(tuple(shards))

    def wrap(self, variable) -> PsVector:
        """Returns a `PsVector` view of an existing 1-D float64 variable; no copy.

        Args:
          variable: a `tf.Variable` or a `ShardedVariable` (as created under a
            ParameterServerStrategy's scope with a partitioner) on ps tasks. Writes
            through the view change `variable`.

        Raises:
          ValueError: if it is not 1-D float64 or a shard is not on a ps task.
        """
        shards = tuple(getattr(variable, "variables", (variable,)))
        for shard in shards:
            if shard.dtype != _DTYPE or shard.shape.rank != 1:
                raise checks.argument_error(
                    "variable",
                    "1-D float64",
                    shard,
                    described=f"a shard of dtype {shard.dtype.name} and shape "
                    f"{shard.shape}",
                )
            if _PS_JOB not in shard.device:
                raise ValueError(
                    "Argument `variable` must live on ps tasks. Received a shard on "
                    f"{shard.device!r}"
                )
        return PsVector(shards)

    def to_numpy(self, x: PsVector) -> np.ndarray:
        self.round_trips["to_numpy"] += 1
        return np.concatenate([s.numpy() for s in x.shards])

    def zeros_like(self, x: PsVector) -> PsVector:
        self.round_trips["zeros_like"] += 1
        shards = []
        for shard in x.shards:
            with tf.device(shard.device):
                # A callable initial value runs under the device scope, on the ps task.
                shards.append(
                    tf.Variable(
                        lambda s=shard: tf.zeros(s.shape, _DTYPE),
                        dtype=_DTYPE,
                        trainable=False,
                    )
                )
        return PsVector(tuple(shards))

    def copy(self, x: PsVector) -> PsVector:
        y = self.zeros_like(x)
        self.assign(x, y)
        return y

    # ----------------------------------------------------------- operations

    def _run(self, name: str, alpha: float, x: PsVector, y: PsVector) -> None:
        _check_same_layout(x, y)
        self.round_trips[name] += 1
        _ELEMENTWISE[name](y.devices, tf.constant(alpha, _DTYPE), x.shards, y.shards)

    def assign(self, x: PsVector, y: PsVector) -> None:
        self._run("assign", 0.0, x, y)

    def dot(self, x: PsVector, y: PsVector) -> float:
        _check_same_layout(x, y)
        self.round_trips["dot"] += 1
        partial_sum = _dot(self.coordinator_device, y.devices, x.shards, y.shards)
        return float(partial_sum.numpy())

    def scale(self, alpha: float, x: PsVector) -> None:
        self._run("scale", alpha, x, x)

    def axpy(self, alpha: float, x: PsVector, y: PsVector) -> None:
        self._run("axpy", alpha, x, y)

    def add(self, x: PsVector, y: PsVector) -> None:
        self._run("add", 0.0, x, y)

    def multiply(self, x: PsVector, y: PsVector) -> None:
        self._run("multiply", 0.0, x, y)

    def combine(
        self,
        coefficients: Sequence[float],
        vectors: Sequence[PsVector],
        out: PsVector,
    ) -> None:
        """Sets `out <- sum_j coefficients[j] * vectors[j]`; one call.

        See `vector_ops.VectorOps.combine`. Each shard sums its slices in
        order; the coordinator sends only the `k` coefficients.
        """
        vector_ops.check_combination(coefficients, vectors)
        for x in vectors:
            _check_same_layout(x, out)
        self.round_trips["combine"] += 1
        ps_batched.combine(
            out.devices,
            tf.constant(coefficients, _DTYPE),
            tuple(x.shards for x in vectors),
            out.shards,
        )

    def gram(
        self,
        rows: Sequence[PsVector],
        columns: Sequence[PsVector],
        updates: Sequence[tuple[Sequence[float], Sequence[PsVector], PsVector]] = (),
    ) -> np.ndarray:
        """Applies `updates`, returns `[r, c]` dot products; one call.

        See `vector_ops.VectorOps.gram`. Each shard applies the updates to its
        slices, then computes its `[r, c]` block of partial dot products with
        one matmul; the coordinator receives only the blocks' sum.
        """
        like = rows[0]
        for x in [*rows, *columns]:
            _check_same_layout(x, like)
        packed = []
        for coefficients, vectors, out in updates:
            vector_ops.check_combination(coefficients, vectors)
            for x in vectors:
                _check_same_layout(x, like)
            _check_same_layout(out, like)
            packed.append(
                (
                    tf.constant(coefficients, _DTYPE),
                    tuple(x.shards for x in vectors),
                    out.shards,
                )
            )
        self.round_trips["gram"] += 1
        result = ps_batched.gram(
            self.coordinator_device,
            like.devices,
            tuple(packed),
            tuple(x.shards for x in rows),
            tuple(x.shards for x in columns),
        )
        return result.numpy()

    def traced_graphs(self, x: PsVector, y: PsVector) -> dict[str, tf.Graph]:
        """The graph each operation runs on vectors laid out like `x` and `y`.

        For inspecting placement: every op's requested device is in its graph, and
        the graph's outputs are all that returns to the coordinator.

        Returns:
          `{"assign": graph, "scale": ..., "axpy": ..., "add": ..., "multiply": ...,
          "dot": ..., "combine": ..., "gram": ...}`; the element-wise graphs
          write `y` (`scale` writes `x`); `combine` writes `y <- x + 2 y`;
          `gram` sets `y <- x - y`, then returns `[x, y]·[x, y]`, `[2, 2]`.
        """
        alpha = tf.constant(1.0, _DTYPE)
        graphs = {
            name: fn.get_concrete_function(
                out.devices, alpha, x.shards, out.shards
            ).graph
            for name, fn in _ELEMENTWISE.items()
            for out in [x if name == "scale" else y]
        }
        graphs["dot"] = _dot.get_concrete_function(
            self.coordinator_device, y.devices, x.shards, y.shards
        ).graph
        coefficients = tf.constant([1.0, 2.0], _DTYPE)
        graphs["combine"] = ps_batched.combine.get_concrete_function(
            y.devices, coefficients, (x.shards, y.shards), y.shards
        ).graph
        both = (x.shards, y.shards)
        graphs["gram"] = ps_batched.gram.get_concrete_function(
            self.coordinator_device,
            y.devices,
            ((tf.constant([1.0, -1.0], _DTYPE), both, y.shards),),
            both,
            both,
        ).graph
        return graphs


def _check_same_layout(x: PsVector, y: PsVector) -> None:
    if x.sizes != y.sizes:
        raise ValueError(
            "Arguments `x` and `y` must have the same shard sizes; create vectors "
            "with `copy` or `zeros_like` of one another. Received shard sizes "
            f"{x.sizes} and {y.sizes}"
        )
