"""Sparse fetches: a fetch sends only the entries the ps changed since the
replica's last one (`push_rules.sparse_fetches`, `downpour.sparse_fetch`).

The NumPy reference (`schedule.simulate`) fetches the whole model and counts
the bytes of the flagged entries; the trainer on a real cluster must end at
the reference's parameters exactly (so its mirror of the ps held what a whole
fetch would have) and count the same bytes from the tensors it sent: one
worker, and two workers whose steps run one at a time in the order read back
from their step counters (each replica then also fetches what the other's
pushes changed).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import tf_keras

from tests.fixtures import launch
from tests.fixtures.downpour import (
    STEPS,
    _batches,
    _dataset,
    _ps_params,
    _reference,
    _softmax_data,
    _softmax_model,
    _steps_one_at_a_time,
    _strategy,
)
from tf_distbelief import downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import replica_state
from tf_distbelief.downpour.push_rules import sparse_fetches

Config = downpour_config.DownpourConfig


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"n_fetch": 2, "n_push": 2, "sparse_fetches": True},
            ValueError,
            r"`sparse_fetches` needs a push rule that selects the entries a push "
            r"sends \(`top_k_fraction`\).*Received: push rules none",
        ),
        (
            {
                "n_fetch": 2,
                "n_push": 2,
                "adagrad_accumulator": "mean",
                "sparse_fetches": True,
                "quantize_bits": 8,
            },
            ValueError,
            r"`sparse_fetches` needs a push rule that selects.*Received: push "
            r"rules quantize_bits",
        ),
        (
            {"sparse_fetches": True, "top_k_fraction": 0.1},
            ValueError,
            r"`sparse_fetches` needs `n_fetch` >= 2 .*Received: n_fetch=1",
        ),
        (
            {
                "n_fetch": 2,
                "n_push": 2,
                "outer_learning_rate": 0.7,
                "top_k_fraction": 0.1,
                "sparse_fetches": True,
            },
            ValueError,
            r"`sparse_fetches` needs `outer_momentum` 0 with the outer optimizer.*"
            r"Received: outer_momentum=0.9",
        ),
        (
            {"n_fetch": 2, "sparse_fetches": 1, "top_k_fraction": 0.1},
            TypeError,
            r"`sparse_fetches` must be a bool. Received: 1",
        ),
        (
            {
                "n_fetch": 2,
                "n_push": 2,
                "adagrad_accumulator": "mean",
                "top_k_fraction": 0.1,
                "delay_compensation": 0.04,
                "sparse_fetches": True,
            },
            ValueError,
            r"`sparse_fetches` cannot be combined with delay_compensation: .*"
            r"Received: delay_compensation=0.04",
        ),
    ],
)
def test_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Config(**kwargs)


def test_fetch_nbytes_counts_positions_and_values():
    params = [np.zeros((3, 4)), np.zeros(2, np.float32)]
    changed = [np.eye(3, 4, dtype=bool), np.array([True, False])]
    # 3 float64 entries and 1 float32 one, each with an int32 position.
    assert sparse_fetches.fetch_nbytes(changed, params) == 3 * 12 + 1 * 8


def test_reference_fetches_what_pushes_changed():
    """One replica, `n_fetch = n_push = 2`: the first fetch is whole, each
    later one sends the entries the last push sent a non-zero value for."""
    x, y, params = _softmax_data(seed=4)
    config = Config(
        2, 2, adagrad_accumulator="mean", top_k_fraction=0.25, sparse_fetches=True
    )
    _, (stats,) = _reference(params, [_batches(x, y)], config)
    dense = _reference(params, [_batches(x, y)], _dense(config))[1][0]
    model_bytes = sum(p.nbytes for p in params)
    # Kernel 18 entries: 4 (round(4.5) half to even); bias 3: 1 (round(0.75)).
    per_fetch = (4 + 1) * (4 + 8)
    fetches = STEPS // 2
    assert stats.fetches == dense.fetches == fetches
    assert stats.bytes_fetched == model_bytes + (fetches - 1) * per_fetch
    assert dense.bytes_fetched == fetches * model_bytes


# Through each path a fetch takes: a trainer step and `fit`'s segments; AdaGrad
# on the ps, and the outer optimizer without momentum, quantised too.
CONFIGS = {
    "top_k_mean": Config(
        3, 3, adagrad_accumulator="mean", top_k_fraction=0.25, sparse_fetches=True
    ),
    "outer_top_k_q2": Config(
        2,
        2,
        outer_learning_rate=0.7,
        outer_momentum=0.0,
        top_k_fraction=0.3,
        quantize_bits=2,
        quantize_chunk=4,
        sparse_fetches=True,
    ),
}


def _dense(config: Config) -> Config:
    kwargs = {n: getattr(config, n) for n in Config.setting_names()}
    return Config(**(kwargs | {"sparse_fetches": False}))


@pytest.mark.parametrize(
    "name, num_ps",
    [(name, 2) for name in sorted(CONFIGS)] + [("top_k_mean", 1)],
)
def test_trainer_matches_reference_one_worker(local_cluster, name, num_ps):
    config = CONFIGS[name]
    x, y, params = _softmax_data(seed=5)
    # One ps task: the kernel and the bias are one group, fetched as one.
    model = _softmax_model(_strategy(local_cluster, num_ps=num_ps), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y)))
    for _ in range(STEPS):
        trainer.step(iterator)
    trainer.join()
    want, (want_stats,) = _reference(params, [_batches(x, y)], config)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    (stats,) = trainer.stats()
    assert stats.fetches == want_stats.fetches > 1
    assert stats.bytes_fetched == want_stats.bytes_fetched
    dense_stats = _reference(params, [_batches(x, y)], _dense(config))[1][0]
    assert stats.bytes_fetched < dense_stats.bytes_fetched
    groups = trainer.downpour._sparse.groups
    assert [len(g) for g in groups] == ([2] if num_ps == 1 else [1, 1])
    # A restore of the ps values (`write_back`) sets every flag.
    flags = trainer.downpour._sparse.flags
    assert not all(f.numpy().all() for f in flags)
    replica_state.ReplicaState(trainer.downpour).write_back(None)
    assert all(f.numpy().all() for f in flags)


@pytest.mark.parametrize(
    "optimizer, allowed",
    [
        (lambda: tf_keras.optimizers.SGD(0.1), True),
        (lambda: tf_keras.optimizers.Adagrad(0.1), True),
        (lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9), False),
        (lambda: tf_keras.optimizers.Adam(0.1), False),
        (lambda: tf_keras.optimizers.Adagrad(0.1, weight_decay=0.01), False),
    ],
    ids=["sgd", "adagrad", "momentum", "adam", "weight_decay"],
)
def test_ps_optimizers_that_move_unpushed_entries_are_refused(
    local_cluster, optimizer, allowed
):
    config = Config(
        2, 2, adagrad_accumulator="mean", top_k_fraction=0.5, sparse_fetches=True
    )
    x, y, params = _softmax_data(seed=1)
    model = _softmax_model(_strategy(local_cluster), params)
    with model.distribute_strategy.scope():
        model.compile(optimizer(), loss=model.loss)
    if allowed:
        assert downpour.DownpourTrainer(model, config).downpour._sparse is not None
        return
    with pytest.raises(
        ValueError,
        match=r"`sparse_fetches` needs a ps optimizer that changes only the "
        r"entries a push sends.*Received: (SGD with momentum=0.9|Adam|Adagrad, "
        r"weight_decay=0.01)",
    ):
        downpour.DownpourTrainer(model, config)


@pytest.mark.parametrize("num_ps", [2, 1])
def test_fit_in_segments_matches_reference(local_cluster, num_ps):
    """`fit` runs the steps between exchanges in segments (`Downpour.run_steps`).

    With one ps task every variable, flag and step token is there, and each
    push's gated `tf.cond` runs whole on it: the flags' control edges once
    hung every step there (`sparse_fetch.SparseFetch.mark`)."""
    config = Config(
        3,
        3,
        0.05,
        adagrad_accumulator="sum",
        top_k_fraction=0.3,
        top_k_chunk=5,
        sparse_fetches=True,
    )
    x, y, params = _softmax_data(seed=3)
    strategy = _strategy(local_cluster, num_ps=num_ps)
    model = _softmax_model(strategy, params, steps_per_execution=4)
    replicas = downpour.install(model, config)
    assert replicas.runs_segments
    model.fit(_dataset(x, y).repeat(), epochs=1, steps_per_epoch=STEPS, verbose=0)
    want, (want_stats,) = _reference(params, [_batches(x, y)], config)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert replicas.stats()[0].bytes_fetched == want_stats.bytes_fetched


@pytest.mark.slow
def test_trainer_matches_reference_two_workers(local_cluster):
    """Steps one at a time on whichever worker the coordinator picks; the
    order is read back from the per-worker step counters and replayed. Each
    replica's fetch sends what its own and the other's pushes changed."""
    config = Config(
        2, 2, adagrad_accumulator="sum", top_k_fraction=0.2, sparse_fetches=True
    )
    x, y, params = _softmax_data(seed=6)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    order = _steps_one_at_a_time(trainer, iterator, 2 * STEPS)
    assert set(order) == {0, 1}
    batches = [_batches(x, y) * 2] * 2  # Each worker reads the whole set.
    want, want_stats = _reference(params, batches, config, order=order)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    stats = trainer.stats()
    assert [s.fetches for s in stats] == [s.fetches for s in want_stats]
    assert [s.bytes_fetched for s in stats] == [s.bytes_fetched for s in want_stats]
    dense_stats = _reference(params, batches, _dense(config), order=order)[1]
    assert sum(s.bytes_fetched for s in stats) < sum(
        s.bytes_fetched for s in dense_stats
    )


def test_sparse_fetches_without_top_k_is_refused_before_any_server():
    args = ["--downpour", "--n_fetch=4", "--n_push=4", "--sparse_fetches"]
    proc = launch._train(args, uuid.uuid4().hex, timeout=300)
    message = r"Downpour settings: `--sparse_fetches` needs a push rule.*"
    launch.assert_one_refusal_line(proc, message)
