"""Exactly-once step accounting (issue 10): a worker lost mid-step is retried
by the ClusterCoordinator, and no step is applied twice."""

import signal
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.helpers import wait_for_worker_recovery
from tf_distbelief import demos, hooks, job
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits
from tf_distbelief.downpour import DownpourConfig
from tf_distbelief.faults import exactly_once
from tf_distbelief.fit import training

# Steps per `fit` call; calls go on until worker 1 was killed KILLS times
# (each restart takes ~5 s, during which worker 0 trains alone). Without
# exactly-once accounting, 4 kills applied a step twice in the runs tried.
STEPS = 500
KILLS = 4


class _KillAndRestart(threading.Thread):
    """SIGKILLs worker 1 and restarts it, `KILLS` times while steps run.

    A thread, so that each kill lands at a random point of a step in flight
    on worker 1 (fit schedules far ahead of the workers).
    """

    def __init__(self, local_cluster, strategy):
        super().__init__(daemon=True)
        self.local_cluster = local_cluster
        self.strategy = strategy
        self.kills = 0

    def run(self):
        for _ in range(KILLS):
            wait_for_worker_recovery(self.strategy)  # Worker 1 back, stepping.
            time.sleep(1.0)
            self.local_cluster.kill("worker", 1, signal.SIGKILL)
            self.kills += 1
            self.local_cluster.restart("worker", 1)


class _Keras2:
    """A tf_keras digits model trained by `fit.training.fit`."""

    id = "tf_keras"

    def __init__(self, local_cluster, downpour):
        config = job.JobConfig(
            num_workers=2, num_ps=1, steps_per_execution=1, downpour=downpour
        )
        strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 1))
        self.model = job.compile_model(config, strategy, demos.spec("digits"))
        self.strategy = strategy
        self.downpour = downpour

    def fit(self, x, y) -> None:
        training.fit(
            self.model,
            training.dataset_creator(x, y, 32),
            epochs=1,
            steps_per_epoch=STEPS,
            batch_size=32,
            print_fn=lambda _: None,
        )

    def applied(self) -> list[int]:
        """Steps applied on the ps, and with Downpour pushes applied."""
        counts = [int(self.model.optimizer.iterations.numpy())]
        if self.downpour is not None:
            counts.append(int(hooks.of(self.model).state.update_count.numpy()))
        return counts

    def weights(self) -> list:
        return [w.numpy() for w in self.model.weights]

    def tokens_marked(self) -> int:
        """Tokens written into the optimizer's ring on the ps: one per step
        applied (a step traced outside its token's scope wrote none, and its
        update was not gated at all)."""
        ring = exactly_once.tokens_for(self.model.optimizer).ring.numpy()
        return int(np.sum(ring >= 0))


class _Keras3:
    """A Keras 3 digits model trained by `keras3.fit`: each call its own
    counters (stock: `history.applied_steps`; Downpour: pushes applied)."""

    id = "keras3"

    def __init__(self, local_cluster, downpour):
        self.strategy = strategy_lib.DistBeliefStrategy(
            local_cluster.resolver_for(2, 1)
        )
        self.model = digits.build_keras3_model()
        self.downpour = downpour
        self.counts = []
        self.ps_weights = None

    def fit(self, x, y) -> None:
        import keras

        from tf_distbelief import keras3

        history = keras3.fit(
            self.model,
            x,
            y,
            strategy=self.strategy,
            steps_per_epoch=STEPS,
            batch_size=32,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras3.Adagrad(0.1),
            downpour=self.downpour,
            ps_weights=self.ps_weights,
            print_fn=lambda _: None,
        )
        if self.downpour is None:
            self.ps_weights = history.ps_weights  # Trained on, call after call.
            self.counts.append([history.applied_steps])
        else:
            self.counts.append([int(history.downpour.update_count.numpy())] * 2)

    def applied(self) -> list[int]:
        return [sum(c) for c in zip(*self.counts)]

    def weights(self) -> list:
        return [w.numpy() for w in self.model.weights]

    def tokens_marked(self) -> None:
        return None  # Each `keras3.fit` call gates with a ring of its own.


@pytest.mark.slow
@pytest.mark.parametrize("keras", [_Keras2, _Keras3], ids=lambda k: k.id)
@pytest.mark.parametrize(
    "downpour",
    [None, DownpourConfig(n_fetch=1, n_push=1)],
    ids=["stock", "downpour"],
)
def test_worker_kills_never_apply_a_step_twice(local_cluster, keras, downpour):
    (x, y), _ = digits.load_data()
    run = keras(local_cluster, downpour)
    killer = _KillAndRestart(local_cluster, run.strategy)
    calls = 0
    try:
        killer.start()
        while calls == 0 or killer.is_alive():
            run.fit(x, y)
            calls += 1
    finally:
        killer.join()
        if local_cluster.processes[("worker", 1)].poll() is not None:
            local_cluster.restart("worker", 1)
        wait_for_worker_recovery(run.strategy)
    assert killer.kills == KILLS
    # Every step is applied once; with Downpour every step pushes once
    # (n_push=1) and the ps counts each step's push once.
    want = [calls * STEPS] * (1 if downpour is None else 2)
    assert run.applied() == want
    marked = run.tokens_marked()
    assert marked is None or marked == calls * STEPS < exactly_once.SLOTS
    assert np.all([np.isfinite(w).all() for w in run.weights()])


def _gate_ready(token, tokens, apply):
    """`exactly_once.gate` of a step always ready: `apply()` returns True
    and its `after`; a refused or duplicate step returns False."""
    return exactly_once.gate(
        token,
        tokens,
        tf.constant(True),
        apply,
        lambda: (tf.constant(False), []),
        lambda: tf.constant(False),
    )


def test_two_runs_of_one_token_at_once_apply_it_once(local_cluster):
    """The coordinator retries as soon as it sees a worker's loss, so a retry
    can reach the ps while the lost worker's step still runs there (its
    gradients all sent). Here two workers run one token at once, the update
    slowed by ps-side matmuls: the token's check, update and write run under
    one lock, so the second finds the first's token and applies nothing
    (without the lock both read the ring first and both applied)."""
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 1))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        applied = tf.Variable(0, dtype=tf.int64, trainable=False)
        weights = tf.Variable(
            tf.random.stateless_uniform([800, 800], seed=[1, 2]), trainable=False
        )
    tokens = exactly_once.StepTokens(applied, strategy)

    @tf.function
    def step(token):
        def apply():
            with tf.device(applied.device):
                x = weights.read_value()
                for _ in range(6):
                    x = tf.tanh(tf.matmul(x, x) / 800.0)
                with tf.control_dependencies([x]):
                    counted = applied.assign_add(1, read_value=True)
            return tf.constant(True), [counted]

        return _gate_ready(token, tokens, apply)

    rounds = 6
    for token in range(rounds):
        both = [
            coordinator.schedule(step, args=(tf.constant(token, tf.int64),))
            for _ in range(2)
        ]
        coordinator.join()
        assert sorted(bool(r.fetch()) for r in both) == [False, True]
    assert int(applied.numpy()) == rounds
    ring = tokens.ring.numpy()
    np.testing.assert_array_equal(ring[:rounds], np.arange(rounds))


@pytest.mark.slow
def test_a_worker_killed_while_the_ps_applies_its_step_applies_it_once(
    local_cluster,
):
    """A gated update runs on the ps under the lock; a worker killed
    meanwhile does not stop it: the ps ends the update and writes the token,
    so the coordinator's retry (on the same worker, restarted) applies
    nothing. The step runs in a loop, as `fit`'s does, and its worker sends
    the ps a tensor meanwhile, which fails with the worker. Every op of the
    gate that names no device runs on the ring's ps: one placed on the
    worker (here the `tf.identity` of the update's result, as
    `tf_keras_fit.Guard` returns it) made the token's write wait for the worker,
    and the killed worker's step was applied and not marked, so the retry
    applied it again (here 2 of 1; 502 of 500 steps under 4 worker kills)."""
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(1, 1))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        # Each step adds 1 to both, one at the start of its update, one at
        # the end: a step half applied leaves them apart.
        begun = tf.Variable(0, dtype=tf.int64, trainable=False)
        applied = tf.Variable(0, dtype=tf.int64, trainable=False)
        after = tf.Variable(0.0, trainable=False)
        weights = tf.Variable(
            tf.random.stateless_uniform([1000, 1000], seed=[1, 2]), trainable=False
        )
    tokens = exactly_once.StepTokens(applied, strategy)

    def slow(x):
        """Seconds of straight-line matmuls (a loop op stops with its worker)."""
        for _ in range(300):
            x = tf.tanh(tf.matmul(x, x) / 1000.0)
        return x

    @tf.function
    def step(token):
        for k in tf.range(1, dtype=tf.int64):
            done = one(token + k)
        return done

    def one(token):
        def apply():
            with tf.device(applied.device):
                first = begun.assign_add(1, read_value=True)
                x = slow(weights.read_value() + tf.cast(first, tf.float32))
                more = tf.cast(tf.reduce_all(tf.math.is_finite(x)), tf.int64)
                counted = applied.assign_add(more, read_value=True)
            # No device named: the gate puts it on the ring's ps.
            return tf.constant(True), [tf.identity(counted)]

        done = _gate_ready(token, tokens, apply)
        # The worker's own work meanwhile, then sent to the ps: a transfer
        # the ps waits for while it applies the step (the worker's lost, so
        # it fails there).
        y = slow(tf.fill([1000, 1000], tf.cast(token, tf.float32) * 1e-3))
        with tf.device(applied.device):
            after.assign_add(tf.reduce_sum(y))
        return done

    token = 7
    try:
        result = coordinator.schedule(step, args=(tf.constant(token, tf.int64),))
        deadline = time.monotonic() + 120
        while int(begun.numpy()) == 0:  # The ps is in the update.
            assert time.monotonic() < deadline, "the update never began"
            time.sleep(0.01)
        local_cluster.kill("worker", 0, signal.SIGKILL)
        local_cluster.restart("worker", 0)
        coordinator.join()
    finally:
        if local_cluster.processes[("worker", 0)].poll() is not None:
            local_cluster.restart("worker", 0)
        wait_for_worker_recovery(strategy)
    # The killed worker's step was applied whole and marked; its retry
    # found it.
    assert [int(begun.numpy()), int(applied.numpy())] == [1, 1]
    assert bool(result.fetch()) is False
    assert tokens.ring.numpy()[token] == token
