"""Update-stream fetches and the parameter-space residual on a real cluster.

With the outer rule and a compressing rule on, the ps logs each compressed
push and a fetch replays the pushes logged since the replica's last one on
its mirror of the ps (`downpour.stream_fetch`); a push sends the compressed
mirror less cache. The trainer against `update_stream.simulate(
residual="parameter", fetch="stream")`, its NumPy reference: one worker, and
two workers whose steps run one at a time in the order read back from their
step counters, where every fetch must leave the replica's mirror (values
and outer momentum) equal to the ps bit for bit. Then two workers pushing at
once, whose log must replay to the ps in its order, and a mirror put off the
ps, which the checksum finds and a whole fetch puts right.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.downpour import (
    LEARNING_RATE,
    STEPS,
    _batches,
    _dataset,
    _ps_params,
    _softmax_data,
    _softmax_grad,
    _softmax_model,
    _strategy,
)
from tests.fixtures.helpers import cluster_bytes
from tf_distbelief import downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import (
    replica_state,
    stream_fetch,
    update_log,
    update_stream,
)
from tf_distbelief.downpour.push_rules import rule
from tf_distbelief.tf_internals import variables as tf_variables

Config = downpour_config.DownpourConfig
# The outer rule without its default damping of stale pushes (a rule read
# from each push's staleness, which the log then keeps: 8 more bytes per
# replayed push); the two-worker test runs the default too.
OUTER = {"outer_learning_rate": 0.35, "outer_momentum": 0.9, "stale_damping": 0.0}
COMPRESSED = {"top_k_fraction": 0.2, "quantize_bits": 2, "quantize_chunk": 4}


def _exchange(**kwargs) -> update_stream.Exchange:
    settings = dict(
        fraction=COMPRESSED["top_k_fraction"],
        bits=COMPRESSED["quantize_bits"],
        quantize_chunk=COMPRESSED["quantize_chunk"],
        residual="parameter",
        fetch="stream",
        window=update_stream.STREAM_WINDOW,
        positions="wire",
    )
    return update_stream.Exchange(**(settings | kwargs))


def _simulate(
    params, batches, config, exchange, order=None, final_round=False, **rules
):
    return update_stream.simulate(
        params,
        _softmax_grad,
        batches,
        Config(config.n_fetch, config.n_push, **(OUTER | rules)),
        exchange,
        ps_learning_rate=LEARNING_RATE,
        order=order,
        final_round=final_round,
    )


def test_stream_fetches_are_on_with_the_outer_rule_and_compression():
    assert stream_fetch.is_on(Config(3, 3, **OUTER, **COMPRESSED))
    assert stream_fetch.is_on(Config(3, 3, **OUTER, quantize_bits=8))
    assert not stream_fetch.is_on(Config(3, 3, **OUTER))
    assert not stream_fetch.is_on(
        Config(3, 3, adagrad_accumulator="mean", **COMPRESSED)
    )
    sparse = dict(outer_momentum=0.0, top_k_fraction=0.1, sparse_fetches=True)
    assert not stream_fetch.is_on(Config(3, 3, outer_learning_rate=0.7, **sparse))


class _ReadsFetched(rule.PushRule):
    """A correction from the values the pushing replica fetched (as delay
    compensation's), which other replicas' replays lack."""

    name = "test_reads_fetched"
    title = "a correction from the fetched values"
    settings = (rule.Setting("test_reads_fetched", False, "bool", ""),)
    needs_fetched = True


def test_rules_a_replay_cannot_apply_are_refused_with_stream_fetches():
    """A rule reading what the pushing replica fetched is refused; the rules
    applied from the push's staleness and the outer momentum are replayed."""
    match = (
        r"cannot be combined with push rules that read what a replica "
        r"fetched.*`test_reads_fetched`"
    )
    with rule.registered(_ReadsFetched):
        with pytest.raises(ValueError, match=match):
            Config(3, 3, **OUTER, **COMPRESSED, test_reads_fetched=True)
        Config(3, 3, **OUTER, test_reads_fetched=True)  # No compression: no stream.
    for replayed in ({"stale_damping": 1.0}, {"staleness_scaled": True}):
        assert stream_fetch.is_on(Config(3, 3, **(OUTER | replayed), **COMPRESSED))


def test_stream_fetches_need_one_fetch_per_push_round():
    match = r"needs `n_fetch` equal to `n_push`.*Received: n_fetch=6, n_push=3"
    with pytest.raises(ValueError, match=match):
        Config(6, 3, **OUTER, **COMPRESSED)
    # With sparse fetches (outer momentum 0) a fetch is not a replay.
    sparse = dict(outer_momentum=0.0, top_k_fraction=0.1, sparse_fetches=True)
    Config(6, 3, outer_learning_rate=0.7, **sparse)


@pytest.mark.parametrize("num_ps", [2, 1], ids=["two_logs", "one_log"])
def test_trainer_matches_update_stream_one_worker(local_cluster, num_ps):
    """With 2 ps tasks each variable has its own log; with 1, the kernel and
    the bias share one (their parts concatenated in each entry)."""
    config = Config(3, 3, **OUTER, **COMPRESSED)
    x, y, params = _softmax_data(seed=5)
    model = _softmax_model(_strategy(local_cluster, num_ps=num_ps), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    for _ in range(STEPS):
        trainer.step(iterator)
    trainer.join()
    want, (want_stats,) = _simulate(params, [_batches(x, y)], config, _exchange())
    reset, _ = _simulate(
        params, [_batches(x, y)], config, _exchange(residual="reset", fetch="whole")
    )
    for got, w, r in zip(_ps_params(model), want, reset):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
        assert np.abs(w - r).max() > 1e-4  # The residual and fetch matter.
    (stats,) = trainer.stats()
    assert (stats.fetches, stats.pushes, stats.bytes_pushed) == (
        want_stats.fetches,
        want_stats.pushes,
        want_stats.bytes_pushed,
    )
    assert want_stats.whole_fetches == 1
    stream = trainer.downpour._stream
    logs = num_ps  # One log per ps task (and dtype).
    assert stream.groups == ([[0], [1]] if num_ps == 2 else [[0, 1]])
    # A whole fetch (no momentum yet), then one replayed push per fetch, the
    # replica's own: per log its sequence number, the push's replica index
    # and the replayed entry's checksum (8 bytes each); its parts are the
    # replica's copy.
    model_bytes = sum(p.nbytes for p in params)
    replays = want_stats.fetches - 1
    assert want_stats.updates_replayed == replays
    assert stats.bytes_fetched == model_bytes + stats.fetches * 8 * logs + (
        replays * 8 * 2 * logs
    )
    # As for two workers below.
    extra = 8 * logs * stats.fetches + 8 * (logs - 1) * replays + 8 * logs * replays
    assert stats.bytes_fetched == want_stats.bytes_fetched + extra
    assert _resyncs(trainer) == [0]
    assert _logged(stream) == [stats.pushes] * logs
    assert trainer.downpour._exchange.compression.residuals == []
    # A restore of the ps values moves each log past every mirror: the next
    # fetch is whole (values and momentum) and the mirror is the ps's.
    replica_state.ReplicaState(trainer.downpour).write_back(None)
    seqs = [int(s.numpy()) for s in stream.log.seqs]
    assert all(n > stats.pushes + stream.log.capacity for n in _logged(stream))
    assert [int(f.numpy()) for f in stream.log.floors] == seqs
    trainer.step(iterator)  # A fetch (the replica starts fresh), no push.
    trainer.join()
    values, momentums = _mirrors(stream, 0)
    ps_values, ps_momentums = _ps_state(stream)
    for got, w in zip(values + momentums, ps_values + ps_momentums):
        np.testing.assert_array_equal(got, w)
    assert list(stream._seen.read_all()[0].numpy()) == seqs
    # The replica's counters started anew with `write_back(None)`.
    after = trainer.stats()[0]
    assert (after.fetches, after.bytes_fetched) == (1, 2 * model_bytes + 8 * logs)


def test_a_refused_push_resets_the_cache_to_the_ps(local_cluster):
    """A push with a NaN (`nonfinite="skip"`) is refused whole: the ps and its
    log do not change, the replica drops its mirror, and its next fetch is
    whole and resets its cache to the ps values; training goes on."""
    config = Config(2, 2, **OUTER, **COMPRESSED)
    x, y, params = _softmax_data(seed=7)
    x[2 * 4, 0] = np.nan  # The third batch: step 2's local step, step 3 pushes.
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    trainer.downpour.nonfinite = "skip"
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y)))
    stream = trainer.downpour._stream
    for _ in range(3):
        trainer.step(iterator)
    trainer.join()
    before = _ps_state(stream)
    trainer.step(iterator)  # Step 3: the refused push.
    trainer.join()
    for a, b in zip(_ps_state(stream)[0], before[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert _logged(stream) == [1, 1]
    assert list(stream._seen.read_all()[0].numpy()) == [-1, -1]
    trainer.step(iterator)  # Step 4: a whole fetch.
    trainer.join()
    caches = [c.read_all()[0].numpy() for c in trainer.downpour._dense.caches]
    assert all(np.isfinite(c).all() for c in caches)
    for _ in range(3):
        trainer.step(iterator)
    trainer.join()
    assert _logged(stream) == [3, 3]
    assert all(np.isfinite(p).all() for p in _ps_params(model))
    assert trainer.stats()[0].nonfinite_pushes == 1


def _resyncs(trainer):
    """Each replica's stream fetches that went whole on a checksum mismatch."""
    counter = trainer.downpour._stream.resync_counter
    return [int(x.numpy()) for x in counter.read_all()]


def _logged(stream):
    """Each log's sequence number from its start."""
    return [int(s.numpy()) - stream.log.origin for s in stream.log.seqs]


def _mirrors(stream, worker):
    values = [m.read_all()[worker].numpy() for m in stream.mirrors]
    momentums = [m.read_all()[worker].numpy() for m in stream.mirror_momentums]
    return values, momentums


def _ps_state(stream):
    return (
        [v.numpy() for v in stream.variables],
        [m.numpy() for m in stream.momentums],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "rules",
    [{}, {"stale_damping": None}, {"staleness_scaled": True}],
    ids=["outer", "default_damping", "staleness_scaled"],
)
def test_trainer_matches_update_stream_two_workers(local_cluster, rules):
    """Steps one at a time on whichever worker the coordinator picks; the
    order is read back from the per-worker step counters and replayed. After
    each fetch (a step that fetches does not push with `n = 3`) the fetching
    replica's mirror of the values and of the outer momentum is the ps's:
    with a rule applied from each push's staleness (and the outer momentum)
    too, which the log keeps and each replay applies."""
    config = Config(3, 3, **(OUTER | rules), **COMPRESSED)
    x, y, params = _softmax_data(seed=6)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    stream = trainer.downpour._stream
    steps_var = trainer.downpour._stats["steps"]
    order, counts, checked = [], [0, 0], 0
    for _ in range(2 * STEPS):
        trainer.step(iterator)
        trainer.join()
        now = [int(v.numpy()) for v in steps_var.read_all()]
        (worker,) = [i for i in range(2) if now[i] == counts[i] + 1]
        order.append(worker)
        if counts[worker] % config.n_fetch == 0:
            values, momentums = _mirrors(stream, worker)
            ps_values, ps_momentums = _ps_state(stream)
            for got, want in zip(values + momentums, ps_values + ps_momentums):
                np.testing.assert_array_equal(got, want)
            checked += 1
        counts = now
    assert set(order) == {0, 1}
    assert checked == sum(-(-c // config.n_fetch) for c in counts)
    batches = [_batches(x, y) * 2] * 2  # Each worker reads the whole set.
    want, want_stats = _simulate(
        params, batches, config, _exchange(), order=order, **rules
    )
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    stats = trainer.stats()
    assert [s.pushes for s in stats] == [s.pushes for s in want_stats]
    assert [s.bytes_pushed for s in stats] == [s.bytes_pushed for s in want_stats]
    assert all(s.whole_fetches == 1 for s in want_stats)
    assert sum(s.updates_replayed for s in want_stats) > sum(s.pushes for s in stats)
    # The others' pushes travel, each replica's own last one does not: the
    # reference's bytes (a whole fetch, and per replayed push its id and the
    # others' parts) plus, per log (one per ps task here), each fetch's
    # sequence number, a second id per replayed push (each log sends its
    # own) and each stream fetch's checksum.
    # When a rule reads it, each log's replayed push carries its staleness
    # too (8 more bytes per log).
    per_replay = 8 * (3 if rules else 1)
    for s, w in zip(stats, want_stats):
        streamed = s.fetches - w.whole_fetches
        extra = 8 * 2 * s.fetches + per_replay * w.updates_replayed + 8 * 2 * streamed
        assert s.bytes_fetched == w.bytes_fetched + extra
    assert _resyncs(trainer) == [0, 0]
    if rules:
        # The rule acts on a push of staleness 1 (damping) or 2 (the step
        # divided by `max(s, 1)`): the result differs from the outer rule
        # alone exactly when such a push was applied.
        acts = max(s.max_staleness_seen for s in stats) >= (
            1 if "stale_damping" in rules else 2
        )
        assert next(iter(rules)) in config.push_rules
        plain, _ = _simulate(params, batches, config, _exchange(), order=order)
        moved = max(np.abs(w - p).max() for w, p in zip(want, plain))
        assert (moved > 1e-6) == acts
    # The last round: the mean of the replicas' mirror less cache (what
    # compression has not sent, and the steps since the last push) goes to
    # the ps; then each replica's next fetch is whole, its cache the ps's.
    seqs = [int(s.numpy()) for s in stream.log.seqs]
    (line,) = trainer.finish()
    assert "2 of 2 replicas" in line
    last, _ = _simulate(
        params, batches, config, _exchange(), order=order, final_round=True, **rules
    )
    for got, w in zip(_ps_params(model), last):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(last, want)) > 1e-4
    assert [int(x.numpy()) for x in stream.mirrored_flag.read_all()] == [0, 0]
    floors = [int(f.numpy()) for f in stream.log.floors]
    assert all(f > s + stream.log.capacity for f, s in zip(floors, seqs))


def test_a_mirror_off_the_ps_is_resynced_whole(local_cluster):
    """A mirror changed outside a fetch (here by the test: the replica's own
    state) no longer has the checksum the ps logged after the push it
    replays next: that fetch goes on with a whole fetch, counted, after
    which the mirror is the ps's; the fetches after it replay again."""
    config = Config(3, 3, **OUTER, **COMPRESSED)
    x, y, params = _softmax_data(seed=9)
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    stream = trainer.downpour._stream
    for _ in range(3):  # A whole fetch, local steps, a push at step 2.
        trainer.step(iterator)
    trainer.join()
    mirror = tf_variables.worker_variable(stream.mirrors[0], 0, 60.0)
    mirror.assign_add(tf.fill(mirror.shape, tf.constant(1e-3, mirror.dtype)))
    fetched = trainer.stats()[0].bytes_fetched
    trainer.step(iterator)  # Step 3: a fetch, no push.
    trainer.join()
    assert _resyncs(trainer) == [1]
    values, momentums = _mirrors(stream, 0)
    ps_values, ps_momentums = _ps_state(stream)
    for got, want in zip(values + momentums, ps_values + ps_momentums):
        np.testing.assert_array_equal(got, want)
    # Per log (one per variable here) its sequence number, the replayed
    # push's index and its checksum (8 bytes each); the resynced variable's
    # values and momentum.
    resent = 2 * stream.variables[0].numpy().nbytes
    assert trainer.stats()[0].bytes_fetched - fetched == 2 * 3 * 8 + resent
    for _ in range(6):  # Pushes at steps 5 and 8, replayed at 6 and 9.
        trainer.step(iterator)
    trainer.join()
    assert _resyncs(trainer) == [1]
    assert _logged(stream) == [3, 3]
    assert list(stream._seen.read_all()[0].numpy()) == [stream.log.origin + 3] * 2
    values, momentums = _mirrors(stream, 0)
    ps_values, ps_momentums = _ps_state(stream)
    for got, want in zip(values + momentums, ps_values + ps_momentums):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_concurrent_pushes_are_logged_in_update_order(local_cluster):
    """Two workers run their steps at once, many rounds: pushes from both
    land on the ps while the other fetches. Every push is logged once, in the
    order the ps applied them: replaying the log from the initial values
    through the ps's kernel gives, after each entry, that entry's checksum,
    and at the end the ps's values and momentum bit for bit. No stream fetch
    found its mirror off (no resync), and once the pushes stop each worker's
    next fetch leaves its mirror equal to the ps."""
    n = 2
    config = Config(n, n, **OUTER, **COMPRESSED)
    x, y, params = _softmax_data(seed=8)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    stream = trainer.downpour._stream
    initial = [v.numpy() for v in stream.variables]
    rounds = 30  # 60 pushes: the ring (window + 2 entries) keeps them all.
    for _ in range(2 * n * rounds):
        trainer.step(iterator)
    trainer.join()
    stats = trainer.stats()
    pushes = [s.pushes for s in stats]
    total = sum(pushes)
    assert min(pushes) > 0 and total <= stream.log.capacity
    assert _logged(stream) == [total] * 2
    assert _resyncs(trainer) == [0, 0]
    lr, mu = stream.learning_rate, stream.momentum
    for g, group in enumerate(stream.groups):
        slots = [(stream.log.origin + k) % stream.log.capacity for k in range(total)]
        pushers = stream.log.pushers[g].numpy()[slots]
        assert [int(np.sum(pushers == w)) for w in range(2)] == pushes
        logs = [log.numpy() for log in stream.log.logs[g]]
        sums = stream.log.sums[g].numpy()
        ws = [tf.Variable(initial[j]) for j in group]
        ms = [tf.Variable(tf.zeros_like(initial[j])) for j in group]
        for slot in slots:
            packed = [tf.constant(part[slot]) for part in logs]
            for j, w, m, parts in zip(group, ws, ms, stream.log.unpack(g, packed)):
                tf.raw_ops.ResourceApplyKerasMomentum(
                    var=w.handle,
                    accum=m.handle,
                    lr=tf.cast(lr, w.dtype),
                    grad=stream.compression.decode(parts, stream.variables[j]),
                    momentum=tf.cast(mu, w.dtype),
                    use_locking=False,
                    use_nesterov=True,
                )
            assert int(update_log.checksum(ws + ms)) == sums[slot]
        for j, w, m in zip(group, ws, ms):
            np.testing.assert_array_equal(w.numpy(), stream.variables[j].numpy())
            np.testing.assert_array_equal(m.numpy(), stream.momentums[j].numpy())
    # The pushes stopped: a worker's next fetch leaves its mirror the ps's.
    steps_var = trainer.downpour._stats["steps"]
    counts = [int(c.numpy()) for c in steps_var.read_all()]
    checked = set()
    for _ in range(8 * n):
        if len(checked) == 2:
            break
        trainer.step(iterator)
        trainer.join()
        now = [int(c.numpy()) for c in steps_var.read_all()]
        (worker,) = [i for i in range(2) if now[i] == counts[i] + 1]
        if counts[worker] % n == 0:
            values, momentums = _mirrors(stream, worker)
            ps_values, ps_momentums = _ps_state(stream)
            for got, want in zip(values + momentums, ps_values + ps_momentums):
                np.testing.assert_array_equal(got, want)
            checked.add(worker)
        counts = now
    assert checked == {0, 1}
    assert _resyncs(trainer) == [0, 0]


def _bytes_of_steps_without_an_exchange(local_cluster, settings, steps):
    """Bytes on the cluster's sockets of `steps` steps, each scheduled and
    joined alone, that neither fetch nor push (after a first step that
    fetches), one worker, the model on 2 ps tasks."""
    config = Config(10_000, 10_000, **settings)
    x, y, params = _softmax_data(seed=9)
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    for _ in range(2):  # The fetch, and one step with the function in place.
        trainer.step(iterator)
        trainer.join()
    before = cluster_bytes(local_cluster)
    for _ in range(steps):
        trainer.step(iterator)
        trainer.join()
    moved = cluster_bytes(local_cluster) - before
    (stats,) = trainer.stats()
    assert (stats.fetches, stats.pushes) == (1, 0)
    return moved


@pytest.mark.slow
def test_a_step_without_a_fetch_or_push_sends_little_more_than_uncompressed(
    local_cluster,
):
    """A step that neither fetches nor pushes moves, on the sockets, at most
    twice the bytes of the uncompressed outer rule's (the call of the step
    function and the ps variables' handles its fetch and push take, more of
    them with the stream's log). The fetch and push branches run as calls
    not inlined (`control_flow.called_cond`): inlined, each of their ~110
    edges between the worker and a ps carried a dead tensor at every step
    (about 4 times the uncompressed row's bytes)."""
    steps = 20
    plain = _bytes_of_steps_without_an_exchange(local_cluster, OUTER, steps)
    compressed = _bytes_of_steps_without_an_exchange(
        local_cluster, OUTER | COMPRESSED, steps
    )
    assert 0 < compressed <= 2 * plain, (compressed / steps, plain / steps)
