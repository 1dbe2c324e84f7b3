"""The function a Sandblaster work portion runs on a worker (Dean et al. 2012, §4.2).

`build_portion_function` traces it; `objective.SandblasterObjective` schedules it
with `ClusterCoordinator.schedule` and reduces its results with the function
`build_slot_reduction` traces.
One call, `portion_fn([portion, slot, eval_id])` (one int64 `[3]` tensor:
one tensor crosses to the worker, one comes back, so a portion costs the
coordinator two transfers rather than six):

1. Fetch the evaluation point `x_eval` from the ps into this worker's cache,
   unless the cache already holds evaluation `eval_id` (once per worker and
   evaluation, as the paper's replicas fetch once per batch).
2. Slice the portion's examples out of the training set, a constant of the
   function (it reaches each worker once, with the function).
3. Compute the portion's share of the objective,
   `sum_i loss_i / N + (n_p / N) * sum(model.losses)`, and its gradient with
   respect to the flat parameters, the model's weights read as slices of the
   cache (`flat_params.evaluate_at`).
4. Write the gradient into row `slot` of this worker's own slot variable
   (`[num_slots, size]`, a `per_worker_variable`): a local write, nothing
   crosses the network. The reduction at the end of the evaluation sends the
   accepted rows to the ps, all in one call.
5. Return `[share, worker_index, incarnation]` as one int64 `[3]` tensor,
   all the coordinator receives: the float64 `share` bit-cast to int64
   (exact; `unpack_result` casts it back), and `incarnation` to tell a worker
   rebuilt since, whose slots are empty.

Tests and benchmarks slow one worker down (a straggler, to exercise backup
tasks) by passing a `PortionDelayFn`, whose ops the function runs between steps
4 and 5; without one, the function holds no timing op at all.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.sandblaster import flat_params
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = [
    "SlotReduction",
    "PortionDelayFn",
    "build_portion_function",
    "build_slot_reduction",
    "per_example_loss",
    "slot_dtype",
]

# `(worker, compute_secs) -> tf.Tensor | tf.Operation`, traced into the portion
# function after the portion's gradient is written: `worker` is the index of the
# worker running the portion (int64 scalar), `compute_secs` the seconds the
# portion took so far, fetch included (float64 scalar). The portion returns only
# once the ops it returns have run; a test makes a straggler by sleeping in them.
PortionDelayFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor | tf.Operation]

_F64 = tf.float64
_I64 = tf.int64


def _read(handle, dtype=_F64):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def _assign(handle, value):
    return tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def _after(ops, value):
    with tf.control_dependencies(ops):
        return tf.identity(value)


def slot_dtype(layout: flat_params.FlatLayout) -> tf.DType:
    """The dtype a portion's gradient is kept in without rounding.

    The portion function reads the model's weights as `tf.cast` slices of the
    float64 parameters (`flat_params.evaluate_at`), so every element of its
    gradient is the cast of a gradient in that weight's dtype: with every
    weight in float32 or narrower, each element is a float32 value, and a
    float32 slot holds it exactly, in half the bytes.

    Args:
      layout: the model's `flat_params.FlatLayout`.

    Returns:
      `tf.float32` when every weight is a floating dtype of at most 4 bytes,
      else `tf.float64`.
    """
    narrow = all(d.is_floating and d.size <= 4 for d in layout.dtypes)
    return tf.float32 if narrow else _F64


def build_slot_reduction(worker_slots: list, worker_incarnations: list, outs: list):
    """Traces the end-of-evaluation reduction over the workers' gradient slots.

    One call, `reduce(rows_by_worker, order)`, is one multi-device function
    run from the coordinator: worker `w` gathers the rows `rows_by_worker[w]`
    (int32 `[k_w]`) of its slot variable and sends each ps shard its columns;
    ps shard `i` puts the `sum_w k_w = portions` rows in portion order
    (`order`, int32 `[portions]`, indexes the rows concatenated worker by
    worker) and sets `outs[i]` to their float64 sum. Each portion's gradient
    crosses the network once, in one transfer per worker and shard, and the
    sum does not depend on which worker ran which portion.

    Args:
      worker_slots: worker `w`'s own `[num_slots, size]` slot variable, for
        every worker (`tf_variables.worker_variable`).
      worker_incarnations: worker `w`'s own int64 incarnation variable, for
        every worker.
      outs: `[shard_size]` float64 variables, one per ps shard (the gradient).

    Returns:
      The `tf.function`; it returns each worker's incarnation (int64 scalars),
      read after its rows were gathered.
    """
    sizes = [int(out.shape[0]) for out in outs]
    spec = tf.TensorSpec([None], tf.int32)

    @tf.function(autograph=False, input_signature=[[spec] * len(worker_slots), spec])
    def reduce(rows_by_worker, order):
        columns = [[] for _ in outs]
        incarnations = []
        for slots, incarnation, rows in zip(
            worker_slots, worker_incarnations, rows_by_worker
        ):
            with tf.device(slots.device):
                parts = tf.split(tf.gather(slots, rows), sizes, axis=1)
                incarnations.append(_after(parts, incarnation.read_value()))
            for column, part in zip(columns, parts):
                column.append(part)
        assigns = []
        for out, column in zip(outs, columns):
            with tf.device(out.device):
                rows = tf.gather(tf.concat(column, axis=0), order)
                assigns.append(
                    out.assign(tf.reduce_sum(tf.cast(rows, _F64), axis=0)).op
                )
        return [_after(assigns, i) for i in incarnations]

    return reduce


def per_example_loss(loss_fn, model):
    """Returns `(y_true, y_pred) -> per-example losses` for `loss_fn`.

    Args:
      loss_fn: a tf_keras `Loss` (its unreduced `call` is used), a loss name
        (`tf_keras.losses.get`), a callable returning per-example losses, or None
        for the loss `model` was compiled with.

    Raises:
      ValueError: no loss given and the model is not compiled.
      TypeError: `loss_fn` is none of these.
    """
    import tf_keras

    if loss_fn is None:
        loss_fn = getattr(model, "loss", None)
        if loss_fn is None:
            raise ValueError(
                "Argument `loss_fn` is required for an uncompiled model, e.g. "
                "`tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)`. "
                f"Received: None for model {model.name!r}"
            )
    if isinstance(loss_fn, str):
        loss_fn = tf_keras.losses.get(loss_fn)
    if isinstance(loss_fn, tf_keras.losses.Loss):
        return loss_fn.call
    if not callable(loss_fn):
        raise checks.argument_error(
            "loss_fn", "a tf_keras Loss, a loss name or a callable", loss_fn
        )
    return loss_fn


def pack_call(portion: int, slot: int, eval_id: int) -> tf.Tensor:
    """The portion function's argument: int64 `[3]`, `[portion, slot, eval_id]`."""
    return tf.constant([portion, slot, eval_id], _I64)


def unpack_result(result) -> tuple[float, int, int]:
    """`(share, worker, incarnation)` from the portion function's int64 `[3]`.

    Args:
      result: the fetched result, a NumPy int64 array of shape `[3]`.

    Returns:
      The loss share (float64, bit-exact), the worker index and its
      incarnation number.
    """
    result = np.asarray(result, np.int64)
    return float(result[:1].view(np.float64)[0]), int(result[1]), int(result[2])


def build_portion_function(
    model,
    layout: flat_params.FlatLayout,
    loss_fn,
    x,
    y,
    portion_bounds: list[int],
    x_eval,
    slots_variable,
    cache_variable,
    cached_eval_variable,
    incarnation_variable,
    portion_delay_fn: PortionDelayFn | None = None,
):
    """Traces the portion function; returns it as a `ConcreteFunction`.

    Args:
      model: the tf_keras model; its weights are substituted, never read.
      layout: the model's `flat_params.FlatLayout`.
      loss_fn: `(y_true, y_pred) -> per-example losses` (`per_example_loss`).
      x: training features, `[num_examples, ...]`, NumPy.
      y: training targets, `[num_examples, ...]`, NumPy.
      portion_bounds: `portions + 1` example offsets.
      x_eval: the `ps_vectors.PsVector` of the evaluation point.
      slots_variable: `per_worker_variable` `[num_slots, layout.size]` of
        `slot_dtype(layout)`: each worker's gradient slots.
      cache_variable: `per_worker_variable` `[layout.size]` float64.
      cached_eval_variable: `per_worker_variable` int64 scalar, the evaluation
        id the cache holds.
      incarnation_variable: `per_worker_variable` int64 scalar, drawn at
        random when the worker's variables are (re)built; the portion returns
        it, so that the coordinator can tell a restarted worker's empty slots.
      portion_delay_fn: run after the gradient is written (`PortionDelayFn`),
        or None.

    Raises:
      ValueError: the model reads a weight in a way that cannot be substituted
        (the weight's variable was captured by the function).
    """
    num_examples = len(x)
    x_shards = x_eval.shards

    @tf.function(autograph=False)
    def portion_fn(call):
        portion, slot, eval_id = call[0], call[1], call[2]
        # Per-worker handles at the top: inside `tf.cond` they would not
        # resolve to the worker running the function.
        cache, cached_eval = cache_variable.handle, cached_eval_variable.handle
        slots = slots_variable.handle
        incarnation = incarnation_variable.handle
        # Timed only for the delay function; the start comes before the fetch.
        start = [] if portion_delay_fn is None else [tf.timestamp()]

        def fetch():
            params = tf.concat([_read(s.handle) for s in x_shards], axis=0)
            return _after([_assign(cache, params), _assign(cached_eval, eval_id)], 1)

        with tf.control_dependencies(start):
            fetched = tf.cond(
                tf.not_equal(_read(cached_eval, _I64), eval_id),
                fetch,
                lambda: tf.constant(0),
            )
        with tf.control_dependencies([fetched]):
            params = _read(cache)
        bounds = tf.constant(portion_bounds, _I64)
        begin, end = bounds[portion], bounds[portion + 1]
        features = tf.constant(x)[begin:end]
        targets = tf.constant(y)[begin:end]
        with tf.GradientTape() as tape:
            tape.watch(params)
            with flat_params.evaluate_at(layout, params):
                predictions = model(features, training=False)
                total = tf.reduce_sum(tf.cast(loss_fn(targets, predictions), _F64))
                share = total / num_examples
                if model.losses:
                    weight = tf.cast(end - begin, _F64) / num_examples
                    regularization = tf.add_n([tf.cast(r, _F64) for r in model.losses])
                    share += weight * regularization
        grad = tape.gradient(
            share, params, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        writes = [
            tf.raw_ops.ResourceScatterUpdate(
                resource=slots,
                indices=tf.reshape(slot, [1]),
                updates=tf.cast(grad, slots_variable.dtype)[None],
            )
        ]
        worker = tf.cast(
            tf.distribute.coordinator.experimental_get_current_worker_index(), _I64
        )
        done = writes
        if portion_delay_fn is not None:
            with tf.control_dependencies(writes):
                compute_secs = tf.timestamp() - start[0]
            done = [portion_delay_fn(worker, compute_secs)]
        with tf.control_dependencies(done):
            return tf.stack([tf.bitcast(share, _I64), worker, _read(incarnation, _I64)])

    # Traced here, where the model's weights can be substituted; the
    # coordinator schedules this concrete function.
    concrete = portion_fn.get_concrete_function(tf.TensorSpec([3], _I64))
    captured = {id(t) for t in concrete.graph.external_captures}
    leaked = [v.name for v in layout.variables if id(v.handle) in captured]
    if leaked:
        raise ValueError(
            "Argument `model` reads weights in a way Sandblaster cannot "
            f"substitute ({', '.join(leaked)} captured by the portion function)."
        )
    return concrete


# Longest wait, in seconds, for a worker's own slot variable at the end of an
# evaluation (it exists once the worker ran a portion; a lost worker's is
# rebuilt when it reconnects).
_WAIT_SECS = 60.0


class SlotReduction:
    """Sums the accepted slots into the gradient on the ps, in portion order.

    Step 5 of `objective`'s protocol: one multi-device function
    (`build_slot_reduction`) has each worker send the rows of its accepted
    slots to the ps shards, which sum them in portion order; it is rebuilt
    when a worker's per-worker variables were (a restarted worker).

    Args:
      slots: the per-worker slot variable, `[num_slots, size]`.
      incarnation: the per-worker incarnation number, int64 scalar.
      grad_shards: the gradient `PsVector`'s shards, written in place.
      num_workers: the workers.
    """

    def __init__(self, slots, incarnation, grad_shards, num_workers: int):
        self._slots, self._incarnation = slots, incarnation
        self._grad_shards, self._num_workers = grad_shards, num_workers
        self._functions: dict[tuple, Callable] = {}

    def __call__(self, slots, workers) -> list[int]:
        """Sums slot `slots[i]` of worker `workers[i]` for each portion `i`.

        Returns:
          Each worker's incarnation number, read in the same call.

        Raises:
          tf.errors.UnavailableError: a worker's variables were not there
            within 60 s; or what the reduction raises when a task is lost.
        """
        rows = [[] for _ in range(self._num_workers)]
        order = []
        for slot, worker in zip(slots, workers):
            order.append((worker, len(rows[worker])))
            rows[worker].append(slot)
        starts = np.cumsum([0] + [len(r) for r in rows])
        variables = []
        for index in range(self._num_workers):
            for per_worker in (self._slots, self._incarnation):
                variable = tf_variables.worker_variable(per_worker, index, _WAIT_SECS)
                if variable is None:
                    raise tf.errors.UnavailableError(
                        None,
                        None,
                        f"worker {index}'s {per_worker.name} was not there within "
                        f"{_WAIT_SECS:g} s",
                    )
                variables.append(variable)
        key = tuple(id(v) for v in variables)
        if key not in self._functions:
            self._functions = {
                key: build_slot_reduction(
                    variables[0::2], variables[1::2], self._grad_shards
                )
            }
        incarnations = self._functions[key](
            [tf.constant(r, tf.int32, shape=[len(r)]) for r in rows],
            tf.constant([starts[w] + i for w, i in order], tf.int32),
        )
        return [int(i) for i in incarnations]

    def ps_shards_answer(self) -> bool:
        """Whether every ps shard of the gradient can still be read.

        A ps task that stopped refuses the read; one restarted since has lost
        the variable (and the eager context): either way the read raises.
        """
        try:
            for shard in self._grad_shards:
                with tf.device(shard.device):
                    shard[:1].numpy()
        except tf.errors.OpError:
            return False
        return True
