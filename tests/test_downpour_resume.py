"""Downpour resume (issue 10): what of a replica's state a resume keeps.

A replica's cache, its gradient sums and its counters live on its worker
(`per_worker_variable=True`) and are not in a checkpoint (`downpour.keras`,
"Resume"). With 1 worker, a fixed batch, and checkpoints at the replica's
push boundaries (steps a multiple of `n_fetch` and `n_push`), nothing is
pending at a checkpoint, so a resumed run equals an uninterrupted one bit for
bit: the ps variables, the ps AdaGrad accumulators, the iteration count. The
test takes a local SGD step: a local AdaGrad step's accumulator restarts at
its initial value on a resume (the module docstring of `downpour.keras`).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tf_distbelief import downpour, training
from tf_distbelief import strategy as strategy_lib

FEATURES, CLASSES, BATCH = 4, 3, 8
X = np.linspace(-1.0, 1.0, BATCH * FEATURES, dtype=np.float32).reshape(BATCH, -1)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES
N = 2  # n_fetch = n_push.
STEPS_PER_EPOCH = 2 * N


@pytest.fixture(scope="module")
def strategy(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, 2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    downpour.enable(strategy)
    return strategy


def _model(strategy, local_optimizer, **push_rules):
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.InputLayer(input_shape=(FEATURES,)),
                tf_keras.layers.Dense(
                    CLASSES,
                    kernel_initializer=tf_keras.initializers.GlorotUniform(0),
                    name="logits",
                ),
            ]
        )
        model.compile(
            tfdb.Adagrad(0.5),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
        )
        config = downpour.DownpourConfig(
            n_fetch=N, n_push=N, local_optimizer=local_optimizer, **push_rules
        )
        model.downpour = downpour.install(model, config)
    return model


def _fit(model, epochs, model_dir=None):
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensors((X, Y)).repeat()
    )
    return training.fit(
        model,
        data,
        epochs=epochs,
        steps_per_epoch=STEPS_PER_EPOCH,
        batch_size=BATCH,
        model_dir=model_dir,
        print_fn=lambda _: None,
    )


def _state(model):
    """The ps variables, the ps AdaGrad accumulators and the iteration count."""
    optimizer = model.optimizer
    rules = model.downpour._exchange.rules
    momentums = [m.numpy() for m in rules.momentums] if rules else []
    return [v.numpy() for v in model.trainable_weights] + [
        a.numpy() for a in optimizer._accumulators
    ] + momentums, int(optimizer.iterations.numpy())


@pytest.mark.slow
@pytest.mark.parametrize(
    "push_rules",
    [{}, {"outer_learning_rate": 0.7, "staleness_scaled": True}],
    ids=["plain", "outer_nesterov"],
)
def test_resume_at_a_push_boundary_equals_an_uninterrupted_run(
    strategy, tmp_path, push_rules
):
    """With the outer optimizer its momentum slots restore too (issue 14)."""
    first = _model(strategy, "sgd", **push_rules)
    _fit(first, 1, str(tmp_path))
    resumed = _model(strategy, "sgd", **push_rules)
    result = _fit(resumed, 2, str(tmp_path))
    assert result.initial_step == STEPS_PER_EPOCH
    uninterrupted = _model(strategy, "sgd", **push_rules)
    _fit(uninterrupted, 2)
    if push_rules:  # 2 sharded variables, 2 shards each: 4 momentum slots.
        momentums = uninterrupted.downpour._exchange.rules.momentums
        assert len(momentums) == 4
        assert all(np.abs(m.numpy()).max() > 0 for m in momentums)
    got, got_iterations = _state(resumed)
    want, want_iterations = _state(uninterrupted)
    assert got_iterations == want_iterations == 2 * STEPS_PER_EPOCH // N
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
