"""Tests for `sandblaster.ps_vectors` on the shared local cluster (1 worker, 3 ps)."""

import collections
import time

import numpy as np
import pytest
import scipy.optimize
import sklearn.datasets
import tensorflow as tf

from tf_distbelief import strategy as strategy_lib
from tf_distbelief.sandblaster import lbfgs, ps_batched, ps_vectors, vector_ops

_NUM_WORKERS = 1
_NUM_PS = 3
_WORKER_DEVICE = "/job:worker/replica:0/task:0/device:CPU:0"


@pytest.fixture
def strategy(local_cluster):
    """A strategy on the shared cluster's first worker and 3 ps tasks.

    A new view of the session's `local_cluster` per test (about 0.3 s): a process
    can be connected to one cluster only, so no test makes servers of its own.
    """
    resolver = local_cluster.resolver_for(num_workers=_NUM_WORKERS, num_ps=_NUM_PS)
    return strategy_lib.DistBeliefStrategy(
        resolver, tf.distribute.experimental.partitioners.FixedShardsPartitioner(3)
    )


def ps_device(task):
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


# ------------------------------------------------------------------ vector ops


@pytest.mark.parametrize("size,num_shards", [(7, 1), (7, 2), (7, 3), (7, 4), (2, 3)])
def test_vector_ops_match_numpy(strategy, size, num_shards):
    ops = ps_vectors.PsVectorOps(strategy, num_shards=num_shards)
    reference = vector_ops.NumpyVectorOps()
    rng = np.random.default_rng(size * 10 + num_shards)
    a, b = rng.normal(size=size), rng.normal(size=size)
    x, y = ops.from_numpy(a), ops.from_numpy(b)
    xr, yr = reference.from_numpy(a), reference.from_numpy(b)

    sizes = ps_vectors.shard_sizes(size, num_shards)
    assert x.sizes == tuple(sizes) and x.size == size
    assert x.devices == tuple(ps_device(i % _NUM_PS) for i in range(len(sizes)))

    assert ops.dot(x, y) == pytest.approx(reference.dot(xr, yr), rel=1e-14)
    for name, args in [
        ("axpy", (0.5,)),
        ("scale", (-3.0,)),
        ("add", ()),
        ("multiply", ()),
        ("assign", ()),
    ]:
        if name == "scale":
            ops.scale(*args, y), reference.scale(*args, yr)
        else:
            getattr(ops, name)(*args, x, y), getattr(reference, name)(*args, xr, yr)
        np.testing.assert_allclose(ops.to_numpy(y), yr, rtol=1e-15, err_msg=name)

    z = ops.copy(x)
    assert z.devices == x.devices
    ops.scale(0.0, z)
    np.testing.assert_array_equal(ops.to_numpy(x), a)
    np.testing.assert_array_equal(ops.to_numpy(z), np.zeros(size))
    zeros = ops.zeros_like(x)
    assert zeros.devices == x.devices
    np.testing.assert_array_equal(ops.to_numpy(zeros), np.zeros(size))


@pytest.mark.parametrize("size,num_shards", [(7, 1), (7, 2), (7, 3), (2, 3)])
def test_combine_and_gram_match_numpy(strategy, size, num_shards):
    """Vector-free L-BFGS's two batched operations, each one call."""
    ops = ps_vectors.PsVectorOps(strategy, num_shards=num_shards)
    rng = np.random.default_rng(size * 10 + num_shards)
    a, b, c = rng.normal(size=(3, size))
    x, y, z = (ops.from_numpy(v) for v in (a, b, c))
    out = ops.zeros_like(x)
    ops.round_trips.clear()

    ops.combine([2.0, -0.5, 3.0], [x, y, z], out)
    expected = 2.0 * a + -0.5 * b + 3.0 * c  # Summed in order, as on each shard.
    np.testing.assert_allclose(ops.to_numpy(out), expected, rtol=1e-15)
    # `z <- x - y` first, then the dot products read the new `z`.
    matrix = ops.gram([z, x], [x, y, z, out], [([1.0, -1.0], [x, y], z)])
    assert ops.round_trips == {"combine": 1, "gram": 1, "to_numpy": 1}
    np.testing.assert_array_equal(ops.to_numpy(z), a - b)
    reference = np.array([a - b, a]) @ np.array([a, b, a - b, expected]).T
    np.testing.assert_allclose(matrix, reference, rtol=1e-13)
    assert matrix.shape == (2, 4) and matrix.dtype == np.float64
    with pytest.raises(ValueError, match=r"same shard sizes"):
        ops.gram([x], [ops.from_numpy(np.zeros(size + 1))])


def test_shard_sizes_follow_strategy_div_layout(strategy):
    """Same layout as the strategy's own FixedShardsPartitioner(3)."""
    with strategy.scope():
        variable = tf.Variable(np.arange(10.0))
    ops = ps_vectors.PsVectorOps(strategy)
    assert ops.from_numpy(np.arange(10.0)).sizes == ops.wrap(variable).sizes
    assert ps_vectors.shard_sizes(10, 3) == [4, 3, 3]
    assert ps_vectors.shard_sizes(2, 3) == [1, 1]


def test_operations_run_on_ps_devices_and_return_only_scalars(strategy):
    ops = ps_vectors.PsVectorOps(strategy, num_shards=3)
    x = ops.from_numpy(np.arange(300.0))
    y = ops.zeros_like(x)
    assert [s.device for s in x.shards] == [ps_device(i) for i in range(3)]
    assert [s.device for s in y.shards] == [ps_device(i) for i in range(3)]

    for name, graph in ops.traced_graphs(x, y).items():
        pinned_to = {}
        for op in graph.get_operations():
            if op.type in ("Placeholder", "NoOp", "Identity"):
                continue  # Arguments and outputs; the outputs are checked below.
            if op.type == "ReadVariableOp":
                # A resource op always runs on its variable's device (a ps task).
                assert op.device == "", (name, op.name)
                continue
            assert op.device, f"{name}: {op.type} has no device pin"
            pinned_to.setdefault(op.device, []).append(op.type)
            if op.device == ops.coordinator_device:
                # Only the sum of the partial dot products runs on the coordinator:
                # scalars, or `gram`'s `[2, 2]` blocks.
                assert op.type == "AddN", name
                shape = [] if name != "gram" else [2, 2]
                assert all(t.shape.as_list() == shape for t in op.inputs), name
            if name == "gram" and op.type == "MatMul":
                # One matmul per shard, on the shard's ps task.
                assert op.device in ops.ps_devices, op.device
        assert set(pinned_to) - {ops.coordinator_device} == set(ops.ps_devices), name
        outputs = graph.outputs
        if name == "dot":
            assert [t.shape.rank for t in outputs] == [0]
        elif name == "gram":
            assert [t.shape.as_list() for t in outputs] == [[2, 2]]
        else:
            assert all(t.dtype == tf.resource or t.shape.rank == 0 for t in outputs), (
                name
            )


# --------------------------------------------------------------- L-BFGS


def digits_problem(num_examples=200, l2=1e-2):
    """Multinomial logistic regression on digits: `[65 * 10]` float64 params."""
    data = sklearn.datasets.load_digits()
    features = np.hstack(
        [data.data[:num_examples] / 16.0, np.ones((num_examples, 1))]
    )  # `[num_examples, 65]`, last column the bias input.
    labels = np.eye(10)[data.target[:num_examples]]  # `[num_examples, 10]`
    return features, labels, l2


def numpy_fun_and_grad(problem):
    features, labels, l2 = problem

    def fun_and_grad(x):
        w = x.reshape(features.shape[1], 10)
        logits = features @ w
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        loss = -np.mean(np.sum(labels * log_probs, axis=1)) + 0.5 * l2 * np.sum(w * w)
        grad = features.T @ (np.exp(log_probs) - labels) / len(features) + l2 * w
        return float(loss), grad.ravel()

    return fun_and_grad


def worker_fun_and_grad(problem, ops, x0):
    """Loss and gradient computed on the worker; the gradient is written to ps."""
    features, labels, l2 = problem
    grad_vector = ops.zeros_like(x0)
    sizes = list(x0.sizes)

    @tf.function(autograph=False)
    def step(x_shards, grad_shards):
        with tf.device(_WORKER_DEVICE):
            w = tf.reshape(tf.concat(x_shards, axis=0), [features.shape[1], 10])
            logits = tf.constant(features) @ w
            loss = tf.reduce_mean(
                tf.nn.softmax_cross_entropy_with_logits(tf.constant(labels), logits)
            ) + 0.5 * l2 * tf.reduce_sum(w * w)
            grad = tf.reshape(
                tf.transpose(tf.constant(features))
                @ (tf.nn.softmax(logits) - labels)
                / len(features)
                + l2 * w,
                [-1],
            )
            pieces = tf.split(grad, sizes)
        for shard, piece in zip(grad_shards, pieces):
            with tf.device(shard.device):
                shard.assign(piece)
        return loss

    def fun_and_grad(x):
        loss = step(x.shards, grad_vector.shards)
        return float(loss.numpy()), grad_vector

    return fun_and_grad


# 40 steps bring the loss within 1e-8 (relative) of the optimum.
_LBFGS_ARGS = {
    "m": 5,
    "max_iters": 40,
    "gtol": 1e-8,
    "ftol": 0,
    "record_iterates": True,
}


@pytest.fixture(scope="module")
def numpy_run():
    """The reference: NumPy, the two-loop recursion on vectors (as before
    vector-free L-BFGS)."""
    problem = digits_problem()
    ops = vector_ops.NumpyVectorOps()
    x0 = np.zeros(65 * 10)
    result = lbfgs.minimize(
        numpy_fun_and_grad(problem), x0, ops, two_loop="vectors", **_LBFGS_ARGS
    )
    optimum = scipy.optimize.minimize(
        numpy_fun_and_grad(problem), x0, jac=True, method="L-BFGS-B"
    )
    assert result.num_iters == 40
    assert result.loss == pytest.approx(optimum.fun, rel=1e-7)
    return result


def assert_same_run(result, reference):
    assert result.num_iters == reference.num_iters
    assert result.num_evals == reference.num_evals
    np.testing.assert_allclose(result.loss_history, reference.loss_history, rtol=1e-9)
    np.testing.assert_allclose(result.step_history, reference.step_history, rtol=1e-9)
    assert len(result.iterate_history) == len(reference.iterate_history)
    for k, (a, b) in enumerate(zip(result.iterate_history, reference.iterate_history)):
        assert np.linalg.norm(a - b) <= 1e-9 * np.linalg.norm(b), f"iterate {k}"


# About 5 s per run on 2 cores; vector-free on 2 shards stays in the quick tier.
@pytest.mark.parametrize(
    "two_loop, num_shards",
    [
        pytest.param("vector_free", 1, marks=pytest.mark.slow),
        ("vector_free", 2),
        pytest.param("vector_free", 3, marks=pytest.mark.slow),
        pytest.param("vectors", 1, marks=pytest.mark.slow),
        pytest.param("vectors", 2, marks=pytest.mark.slow),
        pytest.param("vectors", 3, marks=pytest.mark.slow),
    ],
)
def test_distributed_lbfgs_matches_numpy(strategy, numpy_run, two_loop, num_shards):
    """Vector-free on the ps shards: the iterates of the two-loop on vectors."""
    problem = digits_problem()
    ops = ps_vectors.PsVectorOps(strategy, num_shards=num_shards)
    x0 = ops.from_numpy(np.zeros(65 * 10))
    start = time.monotonic()
    result = lbfgs.minimize(
        worker_fun_and_grad(problem, ops, x0),
        x0,
        ops,
        two_loop=two_loop,
        **_LBFGS_ARGS,
    )
    elapsed_secs = time.monotonic() - start
    assert_same_run(result, numpy_run)
    assert result.x.devices == tuple(ps_device(i) for i in range(num_shards))
    assert elapsed_secs < 60


def test_round_trips_per_iteration(strategy):
    """Vector-free, each iteration makes one dot-product reduction (`gram`) and
    one direction update (`combine`) on the ps, plus two per line-search
    evaluation (`combine`: the trial point; `gram`: its gradient's copy and
    slope). The two-loop on vectors makes `4 p + 12 + 4 e` calls with `p`
    pairs and `e` evaluations, and allocates a new pair's storage (two
    `zeros_like`) in each of the first `m` iterations, where the vector-free
    run allocates all `2 m` at the start (with `minimize`'s 5 work vectors)."""
    problem, m = digits_problem(), 3
    per_iteration, traces = {}, {}
    for two_loop in ("vector_free", "vectors"):
        traces[two_loop] = [
            f.experimental_get_tracing_count()
            for f in (ps_batched.combine, ps_batched.gram)
        ]
        ops = ps_vectors.PsVectorOps(strategy, num_shards=3)
        x0 = ops.from_numpy(np.zeros(65 * 10))
        fun_and_grad = worker_fun_and_grad(problem, ops, x0)
        start = lbfgs.minimize(fun_and_grad, x0, ops, m=m, max_iters=0)
        rows, last = [], {}

        def callback(state, ops=ops, rows=rows, last=last):
            calls = ops.round_trips - last["calls"]
            rows.append((calls, state.num_evals - last["evals"], last["pairs"]))
            last.update(calls=collections.Counter(ops.round_trips))
            last.update(evals=state.num_evals, pairs=state.num_pairs)

        if two_loop == "vectors":
            start.state.gram = None
        last.update(calls=collections.Counter(), evals=1, pairs=0)
        ops.round_trips.clear()
        result = lbfgs.minimize(
            fun_and_grad,
            None,
            ops,
            m=m,
            max_iters=8,
            gtol=0,
            ftol=0,
            initial_state=start.state,
            callback=callback,
            two_loop=two_loop,
        )
        assert result.num_iters == 8
        per_iteration[two_loop] = rows
    # Vector-free: each call's signature is the same whatever the number of
    # pairs (the history fills in iterations 1 to 3), so `tf.function` traced
    # each operation at most once: `combine` for the direction and the trial
    # point, `gram` for the first matrix, the new pair and the slope.
    after = [
        f.experimental_get_tracing_count()
        for f in (ps_batched.combine, ps_batched.gram)
    ]
    new_traces = [b - a for a, b in zip(traces["vector_free"], traces["vectors"])]
    assert new_traces[0] <= 2 and new_traces[1] <= 3, new_traces
    assert after == traces["vectors"]  # The two-loop on vectors uses neither.
    for k, (calls, evals, _) in enumerate(per_iteration["vector_free"]):
        expected = {"combine": 1 + evals, "gram": 1 + evals}
        if k == 0:
            expected["zeros_like"] = 2 * m + 5
        assert calls == expected, (k, calls, evals)
    for k, (calls, evals, pairs) in enumerate(per_iteration["vectors"]):
        allocations = calls.pop("zeros_like", 0)
        assert allocations == (7 if k == 0 else 2 if k < m else 0), k
        expected = 4 * pairs + 12 + 4 * evals if pairs else 10 + 4 * evals
        assert sum(calls.values()) == expected, (k, calls, evals, pairs)


@pytest.mark.slow
def test_lbfgs_from_strategy_sharded_variable(strategy, numpy_run):
    """x0 created by the strategy (FixedShardsPartitioner(3)) joins via `wrap`."""
    problem = digits_problem()
    with strategy.scope():
        params = tf.Variable(np.zeros(65 * 10))
    ops = ps_vectors.PsVectorOps(strategy)
    x0 = ops.wrap(params)
    assert len(x0.shards) == 3
    result = lbfgs.minimize(
        worker_fun_and_grad(problem, ops, x0), x0, ops, **_LBFGS_ARGS
    )
    assert_same_run(result, numpy_run)
    np.testing.assert_array_equal(params.numpy(), np.zeros(650))  # x0 untouched
    assert result.x.devices == x0.devices


# ------------------------------------------------------------------ bad inputs


def test_bad_arguments(strategy):
    with pytest.raises(TypeError, match=r"`strategy` must be a .*Received: str"):
        ps_vectors.PsVectorOps("ps")
    with pytest.raises(ValueError, match=r"`num_shards` must be positive. Received: 0"):
        ps_vectors.PsVectorOps(strategy, num_shards=0)
    with pytest.raises(TypeError, match=r"`num_shards` must be an int or None"):
        ps_vectors.PsVectorOps(strategy, num_shards=2.0)
    ops = ps_vectors.PsVectorOps(strategy)
    with pytest.raises(
        ValueError, match=r"`array` must be 1-D .* Received shape: \(2, 2\)"
    ):
        ops.from_numpy(np.zeros((2, 2)))
    with pytest.raises(
        ValueError, match=r"same shard sizes.*\(2, 2, 1\) and \(1, 1, 1\)"
    ):
        ops.dot(ops.from_numpy(np.zeros(5)), ops.from_numpy(np.zeros(3)))
    with tf.device(ps_device(0)):
        float32_variable = tf.Variable(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"must be 1-D float64. Received .* float32"):
        ops.wrap(float32_variable)
    with tf.device(_WORKER_DEVICE):
        worker_variable = tf.Variable(np.zeros(3))
    with pytest.raises(ValueError, match=r"must live on ps tasks. Received .*worker"):
        ops.wrap(worker_variable)
