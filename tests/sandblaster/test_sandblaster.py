"""Sandblaster L-BFGS: pure bookkeeping, then runs on the shared local cluster.

Cluster tests use the session's `local_cluster` (3 workers, 3 ps) through
`resolver_for`: "1 to 3 workers" and 1 to 3 ps shards.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf
import tf_keras

from benchmarks import stragglers
from tests.fixtures.sandblaster import (
    CE,
    EQUAL_PORTIONS,
    _digits_train,
    _full_batch_grad,
    _logistic_model,
    _strategy,
    numpy_fun_and_grad,
)
from tf_distbelief import sandblaster
from tf_distbelief.demos import digits
from tf_distbelief.sandblaster import config as config_lib
from tf_distbelief.sandblaster import flat_params, lbfgs, ps_vectors, vector_ops
from tf_distbelief.sandblaster import objective as sandblaster_objective
from tf_distbelief.sandblaster import portion as sandblaster_portion
from tf_distbelief.sandblaster import schedule as schedule_lib

# --- Pure: portions, ledger, slots, flat layout -------------------------------


def test_portion_bounds():
    assert schedule_lib.portion_bounds(10, 3) == [0, 4, 7, 10]
    assert schedule_lib.portion_bounds(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"`portions` must be in \[1, 5\].*: 6"):
        schedule_lib.portion_bounds(5, 6)
    with pytest.raises(TypeError, match=r"`portions` must be an int.*2.0"):
        schedule_lib.portion_bounds(5, 2.0)


def test_ledger_accepts_first_copy_only():
    ledger = schedule_lib.PortionLedger(3, max_copies=2)
    for p in range(3):
        assert ledger.scheduled(p) == 0
    assert ledger.backups_wanted(idle_workers=0) == []
    assert ledger.finish(1, "p1-primary")
    assert ledger.backups_wanted(idle_workers=5) == [0, 2]
    assert ledger.scheduled(2) == 1
    assert ledger.backups_wanted(idle_workers=5) == [0]  # 2 has its 2 copies
    assert ledger.finish(2, "p2-backup")
    assert not ledger.finish(2, "p2-primary")  # the second copy is dropped
    assert not ledger.complete and ledger.outstanding == [0]
    assert ledger.finish(0, "p0")
    assert ledger.complete
    assert ledger.accepted == ["p0", "p1-primary", "p2-backup"]
    assert schedule_lib.PortionLedger(2, max_copies=1).backups_wanted(4) == []


def test_slot_pool_lends_each_slot_once():
    pool = schedule_lib.SlotPool(2)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError, match="No free gradient slot"):
        pool.acquire()
    pool.release(a)
    with pytest.raises(ValueError, match="not lent out"):
        pool.release(a)
    assert pool.acquire() == a


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"portions": 0}, ValueError, r"Argument `portions` must be >= 1. Received: 0"),
        ({"history": 0}, ValueError, r"Argument `history` must be >= 1. Received: 0"),
        (
            {"max_iters": -1},
            ValueError,
            r"Argument `max_iters` must be >= 1. Received: -1",
        ),
        (
            {"history": 2.5},
            TypeError,
            r"Argument `history` must be an int. Received: 2.5",
        ),
        (
            {"checkpoint_every_iters": 0},
            ValueError,
            r"Argument `checkpoint_every_iters` must be >= 1. Received: 0",
        ),
        (
            {"log_every_iters": -1},
            ValueError,
            r"Argument `log_every_iters` must be >= 0. Received: -1",
        ),
        (
            {"backup_tasks": 1},
            TypeError,
            r"Argument `backup_tasks` must be a bool. Received: 1",
        ),
        (
            {"two_loop": "dense"},
            ValueError,
            r"Argument `two_loop` must be one of \('vector_free', 'vectors'\). "
            r"Received: 'dense'",
        ),
    ],
)
def test_config_errors_name_field_rule_and_value(fields, error, message):
    with pytest.raises(error, match=message):
        config_lib.SandblasterConfig(**fields)


def test_config_defaults():
    config = config_lib.SandblasterConfig()
    assert (config.history, config.max_iters, config.portions) == (10, 100, 32)
    assert config.checkpoint_every_iters == 1
    assert config.log_every_iters == 1
    assert config.backup_tasks
    assert config.two_loop == "vector_free"


def test_pure_modules_import_no_tensorflow():
    code = (
        "import sys\n"
        "from tf_distbelief.sandblaster import (\n"
        "    config, lbfgs, lbfgs_state, line_search, schedule, two_loop,\n"
        "    vector_ops)\n"
        "print(sorted(m for m in ('tensorflow', 'tf_keras') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def _op_types(concrete):
    """Op types of a concrete function, those of its branch functions included."""
    graph_def = concrete.graph.as_graph_def()
    return {n.op for n in graph_def.node} | {
        n.op for f in graph_def.library.function for n in f.node_def
    }


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        (("float32", "float32"), tf.float32),
        (("float16", "float32"), tf.float32),
        (("float32", "float64"), tf.float64),
        (("float64", "float64"), tf.float64),
    ],
)
def test_slot_dtype_holds_the_gradient_exactly(dtypes, expected):
    model = tf_keras.Sequential(
        [
            tf_keras.layers.InputLayer(input_shape=(4,)),
            tf_keras.layers.Dense(3, dtype=dtypes[0]),
            tf_keras.layers.Dense(2, dtype=dtypes[1]),
        ]
    )
    layout = flat_params.FlatLayout(model)
    assert sandblaster_portion.slot_dtype(layout) == expected
    # The float64 gradient of a float32 model holds float32 values only.
    if expected == tf.float32:
        params = tf.constant(np.random.default_rng(0).normal(size=layout.size))
        with tf.GradientTape() as tape:
            tape.watch(params)
            with flat_params.evaluate_at(layout, params):
                out = model(tf.constant(np.ones((5, 4)), dtypes[0]))
                loss = tf.reduce_sum(tf.cast(out, tf.float64) ** 2)
        grad = tape.gradient(loss, params).numpy()
        assert grad.dtype == np.float64 and np.any(grad != 0)
        np.testing.assert_array_equal(grad.astype(np.float32).astype(np.float64), grad)


@pytest.mark.parametrize("share", [0.1, -3.5e-300, 2.0**-1074, np.nextafter(1.0, 2.0)])
def test_portion_result_carries_the_share_bit_for_bit(share):
    packed = tf.stack(
        [
            tf.bitcast(tf.constant(share, tf.float64), tf.int64),
            tf.constant(1, tf.int64),
            tf.constant(2**62 - 1, tf.int64),
        ]
    )
    unpacked = sandblaster_portion.unpack_result(packed.numpy())
    assert unpacked == (share, 1, 2**62 - 1)
    assert np.float64(unpacked[0]).tobytes() == np.float64(share).tobytes()
    np.testing.assert_array_equal(
        sandblaster_portion.pack_call(3, 4, 5).numpy(), [3, 4, 5]
    )


def test_flat_layout_and_evaluate_at():
    model = _logistic_model()
    layout = flat_params.FlatLayout(model)
    assert layout.shapes == ((64, 10), (10,)) and layout.size == 650
    vector = np.arange(650.0)
    kernel, bias = layout.unflatten(vector)
    np.testing.assert_array_equal(kernel, vector[:640].reshape(64, 10))
    np.testing.assert_array_equal(layout.flatten([kernel, bias]), vector)

    features = np.random.default_rng(0).normal(size=(3, 64))

    @tf.function
    def outputs_at(params):
        with flat_params.evaluate_at(layout, params):
            return model(features)

    got = outputs_at(tf.constant(vector / 1000))
    np.testing.assert_allclose(got, features @ kernel / 1000 + bias / 1000)
    # The weights themselves were neither read nor written.
    concrete = outputs_at.get_concrete_function(tf.TensorSpec([650], tf.float64))
    assert not concrete.graph.external_captures
    np.testing.assert_array_equal(layout.read(), np.zeros(650))
    assert type(model.weights[0]).__name__ == "ResourceVariable"
    with pytest.raises(ValueError, match="must be built"):
        flat_params.FlatLayout(tf_keras.Sequential([tf_keras.layers.Dense(2)]))


# --- NumPy reference ----------------------------------------------------------


LBFGS_ARGS = {"m": 10, "max_iters": 200, "record_iterates": True}


@pytest.fixture(scope="module")
def numpy_reference():
    """NumPy, with the two-loop recursion on vectors: the trainer's default
    (vector-free) must repeat its iterates."""
    x, y = _digits_train()
    fun = numpy_fun_and_grad(x, y, EQUAL_PORTIONS)
    result = lbfgs.minimize(
        fun,
        np.zeros(650),
        vector_ops.NumpyVectorOps(),
        two_loop="vectors",
        **LBFGS_ARGS,
    )
    optimum = scipy.optimize.minimize(fun, np.zeros(650), jac=True, method="L-BFGS-B")
    assert result.converged and optimum.success
    return result, optimum


# --- On the cluster -----------------------------------------------------------


_LOCALHOST_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def _ps_device(task):
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


# About 15-25 s per run on 2 busy cores; one configuration in the quick tier.
# Each ps count and each worker count at least once, unequal counts both
# ways, and the largest cluster.
@pytest.mark.parametrize(
    "num_ps, num_workers",
    [
        (2, 2),
        pytest.param(1, 3, marks=pytest.mark.slow),
        pytest.param(3, 1, marks=pytest.mark.slow),
        pytest.param(3, 3, marks=pytest.mark.slow),
    ],
)
def test_distributed_matches_single_process(
    local_cluster, numpy_reference, num_ps, num_workers
):
    reference, optimum = numpy_reference
    x, y = _digits_train()
    trainer = sandblaster.SandblasterTrainer(
        _strategy(local_cluster, num_workers, num_ps),
        _logistic_model(),
        CE,
        x,
        y,
        portions=EQUAL_PORTIONS,
        history=LBFGS_ARGS["m"],
    )
    result = trainer.fit(max_iters=LBFGS_ARGS["max_iters"], record_iterates=True)

    assert result.x.devices == tuple(_ps_device(i) for i in range(num_ps))
    assert result.num_iters == reference.num_iters
    assert result.num_evals == reference.num_evals
    np.testing.assert_allclose(result.loss_history, reference.loss_history, rtol=1e-9)
    # A zoomed step is a cubic minimiser, a ratio of loss differences: it
    # amplifies the last-digit differences of the two sums (seen: 1e-9).
    np.testing.assert_allclose(result.step_history, reference.step_history, rtol=1e-7)
    errors = [
        np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)
        for a, b in zip(result.iterate_history[1:], reference.iterate_history[1:])
    ]
    assert len(errors) == reference.num_iters
    assert max(errors) <= 1e-9, max(errors)
    # The trained weights are in the model.
    weights = np.concatenate([w.ravel() for w in trainer.model.get_weights()])
    np.testing.assert_allclose(weights, reference.x, rtol=1e-9, atol=1e-12)
    # Against SciPy's L-BFGS-B on the same objective.
    assert result.loss == pytest.approx(optimum.fun, rel=1e-6)
    assert abs(result.num_iters - optimum.nit) <= 0.2 * optimum.nit
    stats = trainer.stats
    assert stats.evaluations == result.num_evals
    assert stats.copies_accepted == EQUAL_PORTIONS * result.num_evals
    assert set(stats.accepted_by_worker) <= set(range(num_workers))
    trainer.objective.close()


def test_exactly_once_with_straggler_and_backup_tasks(local_cluster):
    """Worker 1 is 5x slower: its portions get backup copies on worker 0.

    Whichever copies win, every evaluation's gradient is the full-batch one,
    and each portion is accepted exactly once; losing copies are discarded.
    """
    x, y = _digits_train()
    portions, evaluations = 16, 4
    objective = sandblaster.SandblasterObjective(
        _strategy(local_cluster, num_workers=2, num_ps=3),
        _logistic_model(),
        CE,
        x,
        y,
        portions=portions,
        backup_tasks=True,
        portion_delay_fn=stragglers.slow_worker(
            straggler_worker=1, straggler_slowdown=5.0, straggler_delay_secs=0.02
        ),
    )
    rng = np.random.default_rng(1)
    for _ in range(evaluations):
        w = rng.normal(size=650) * 0.1
        loss, grad = objective(objective.ops.from_numpy(w))
        ref_loss, ref_grad = _full_batch_grad(w, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        got = objective.ops.to_numpy(grad)
        assert np.linalg.norm(got - ref_grad) <= 1e-12 * np.linalg.norm(ref_grad)

    # The delay is the test's own op, traced in through `portion_delay_fn`.
    assert "SleepDataset" in _op_types(objective.portion_function)
    stats = objective.stats
    assert stats.evaluations == evaluations
    assert stats.portions_scheduled == portions * evaluations
    assert stats.copies_accepted == portions * evaluations
    assert stats.backup_copies_scheduled >= 1
    # The fast worker did most portions (load balancing).
    assert stats.accepted_by_worker.get(0, 0) > stats.accepted_by_worker.get(1, 0)
    objective.join()  # Let the straggler's losing copies finish.
    assert stats.copies_accepted + stats.copies_discarded == (
        stats.portions_scheduled + stats.backup_copies_scheduled
    )
    assert stats.copies_discarded >= 1  # Both copies of a portion finished.
    objective.close()


def test_without_backup_tasks_no_copies(local_cluster):
    x, y = _digits_train()
    objective = sandblaster.SandblasterObjective(
        _strategy(local_cluster, num_workers=2, num_ps=2),
        _logistic_model(),
        CE,
        x,
        y,
        portions=8,
        backup_tasks=False,
    )
    w = np.random.default_rng(2).normal(size=650) * 0.1
    loss, grad = objective(objective.ops.from_numpy(w))
    ref_loss, ref_grad = _full_batch_grad(w, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(objective.ops.to_numpy(grad), ref_grad, rtol=1e-10)
    objective.close()
    assert objective.stats.backup_copies_scheduled == 0
    assert objective.stats.copies_discarded == 0


def test_fit_prints_a_line_every_log_every_iters_iterations(local_cluster):
    """Each line is printed as its iteration ends, with the loss and gradient
    norm L-BFGS holds then and the evaluations so far."""
    x, y = _digits_train()
    lines = []
    trainer = sandblaster.SandblasterTrainer(
        _strategy(local_cluster, num_workers=2, num_ps=2),
        _logistic_model(),
        CE,
        x,
        y,
        config_lib.SandblasterConfig(max_iters=5, portions=4, log_every_iters=2),
    )
    result = trainer.fit(print_fn=lines.append)
    pattern = (
        r"lbfgs iteration (\d)/5: loss (\S+), gradient norm (\S+), "
        r"(\d+) evaluations, (\d+\.\d) s"
    )
    found = [re.fullmatch(pattern, line) for line in lines]
    assert all(found), lines
    assert [int(m[1]) for m in found] == [2, 4]
    assert result.num_iters == 5
    for m in found:
        # The loss of the iteration's iterate (L-BFGS's loss history).
        assert float(m[2]) == pytest.approx(result.loss_history[int(m[1])], rel=1e-5)
        assert float(m[3]) > 0
        assert int(m[1]) < int(m[4]) <= result.num_evals
    assert float(found[0][5]) <= float(found[1][5])
    trainer.objective.close()


def test_vectors_on_ps_and_coordinator_moves_only_scalars(local_cluster, monkeypatch):
    x, y = _digits_train()
    num_ps = 3
    trainer = sandblaster.SandblasterTrainer(
        _strategy(local_cluster, num_workers=2, num_ps=num_ps),
        _logistic_model(),
        CE,
        x,
        y,
        portions=8,
    )
    objective = trainer.objective
    assert trainer.config == config_lib.SandblasterConfig(portions=8)
    ps = tuple(_ps_device(i) for i in range(num_ps))
    assert objective.grad.devices == ps

    # What a portion takes and returns: one int64 [3] tensor each way (its
    # loss share bit-cast, its worker and that worker's incarnation back).
    portion_fn = objective.portion_function
    assert [(t.dtype, t.shape) for t in portion_fn.inputs[:1]] == [(tf.int64, [3])]
    assert [(t.dtype, t.shape) for t in portion_fn.outputs] == [(tf.int64, [3])]
    # With no `portion_delay_fn`, no sleep and no timing op in production.
    assert not {"SleepDataset", "Timestamp"} & _op_types(portion_fn)
    # Its only write goes to the worker's own gradient slots (a
    # `per_worker_variable`, float64 like this model's weights); nothing it
    # writes is on the ps.
    assert objective.slot_dtype == tf.float64
    writes = [
        op for op in portion_fn.graph.get_operations() if op.type.startswith("Resource")
    ]
    assert [op.type for op in writes] == ["ResourceScatterUpdate"]
    assert not [op for op in writes if "/job:ps" in op.device]

    # Per iteration, no whole vector passes through the coordinator: only the
    # start point (pushed) and the result (pulled) do, once per `fit`.
    moved = []
    for name in ("from_numpy", "to_numpy"):
        original = getattr(ps_vectors.PsVectorOps, name)

        def counted(self, *args, _name=name, _original=original):
            moved.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(ps_vectors.PsVectorOps, name, counted)
    objective.ops.round_trips.clear()
    result = trainer.fit(max_iters=5)
    assert result.num_iters == 5
    assert moved == ["from_numpy", "to_numpy"]
    # The reduction: each worker gathers its accepted rows, each ps shard sums
    # them in portion order into the gradient; it returns only each worker's
    # incarnation (a scalar).
    (reduce,) = objective._reduction._functions.values()
    reduce_graph = reduce.get_concrete_function().graph
    pinned = collections.defaultdict(set)
    for op in reduce_graph.get_operations():
        pinned[op.type].add(op.device.split("/device:")[0])
    workers = {f"/job:worker/replica:0/task:{i}" for i in range(2)}
    assert pinned["ResourceGather"] == workers
    assert pinned["AssignVariableOp"] == {d.split("/device:")[0] for d in ps}
    assert [t.shape.rank for t in reduce_graph.outputs] == [0, 0]
    # Vector-free L-BFGS (the default): per iteration one `gram` (the new
    # pair's dot products) and one `combine` (the direction); per line-search
    # evaluation one `combine` (trial point), one `assign` (the objective's
    # copy of it) and one `gram` (slope). At the start one `dot` (|g|) and one
    # `gram` (the first matrix), and copies of the start point and gradient;
    # 5 work vectors and the storage of all `2 * history` vectors at once.
    searched = result.num_evals - 1
    assert dict(objective.ops.round_trips) == {
        "gram": 1 + 5 + searched,
        "combine": 5 + searched,
        "assign": result.num_evals + 2,
        "dot": 1,
        "zeros_like": 2 + 5 + 2 * 10,
        "from_numpy": 1,
        "to_numpy": 1,
    }
    trainer.objective.close()


@pytest.mark.slow
def test_digits_mlp_accuracy(local_cluster):
    """The launch script's digits MLP (float32, compiled) trained by Sandblaster."""
    (x, y), (x_test, y_test) = digits.load_data()
    start = time.monotonic()
    # The strategy first: connecting resets the eager context, so variables
    # made before it are lost.
    strategy = _strategy(local_cluster, num_workers=2, num_ps=2)
    model = digits.build_model(hidden_units=32)
    model.compile(loss=CE)
    trainer = sandblaster.SandblasterTrainer(
        strategy,
        model,
        None,  # The compiled loss.
        x,
        y,
        portions=16,
        history=10,
    )
    result = trainer.fit(max_iters=60)
    elapsed_secs = time.monotonic() - start
    accuracy = np.mean(np.argmax(model.predict(x_test, verbose=0), axis=1) == y_test)
    assert accuracy >= 0.93, (accuracy, result.message)
    assert elapsed_secs < 90
    trainer.objective.close()


def test_bad_arguments(local_cluster):
    x, y = _digits_train()
    strategy = _strategy(local_cluster, num_workers=1, num_ps=1)
    # A model built before this process first connected lives on `localhost`.
    early = types.SimpleNamespace(
        variables=[types.SimpleNamespace(name="w", device=_LOCALHOST_CPU)]
    )
    with pytest.raises(ValueError, match=r"built after the strategy is created"):
        sandblaster_objective._check_made_after_connecting(
            early, "/job:chief/replica:0/task:0/device:CPU:0"
        )
    with pytest.raises(ValueError, match=r"`loss_fn` is required.*Received: None"):
        sandblaster.SandblasterObjective(strategy, _logistic_model(), None, x, y)
    with pytest.raises(ValueError, match=r"`portions` must be in \[1, 1347\]"):
        sandblaster.SandblasterObjective(
            strategy, _logistic_model(), CE, x, y, portions=0
        )
    with pytest.raises(ValueError, match=r"same, non-zero number.*1347 and 3"):
        sandblaster.SandblasterObjective(strategy, _logistic_model(), CE, x, y[:3])
    with pytest.raises(ValueError, match=r"`straggler_slowdown` >= 1.*0.5"):
        stragglers.slow_worker(straggler_worker=1, straggler_slowdown=0.5)
    with pytest.raises(TypeError, match=r"`loss_fn` must be a tf_keras Loss"):
        sandblaster.SandblasterObjective(strategy, _logistic_model(), 3, x, y)
    with pytest.raises(TypeError, match=r"`portion_delay_fn` must be callable.*: 3"):
        sandblaster.SandblasterObjective(
            strategy, _logistic_model(), CE, x, y, portion_delay_fn=3
        )
    with pytest.raises(TypeError, match=r"`config` must be a `SandblasterConfig`.*8"):
        sandblaster.SandblasterTrainer(strategy, _logistic_model(), CE, x, y, 8)
    with strategy.scope():
        scoped = _logistic_model()
    with pytest.raises(TypeError, match=r"built outside any distribution strategy"):
        sandblaster.SandblasterObjective(strategy, scoped, CE, x, y)
    with pytest.raises(ValueError, match=r"`x` and `y` \(the training set\)"):
        sandblaster.SandblasterTrainer(strategy, _logistic_model(), CE)
