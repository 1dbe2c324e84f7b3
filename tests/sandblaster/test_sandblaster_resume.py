"""Sandblaster L-BFGS checkpoints: a resumed run repeats an uninterrupted one.

On the session's shared local cluster (`conftest.local_cluster`). The chief is
lost by ending its strategy and trainer (a new strategy reconnects this
process, dropping every variable of the old one); `test_launch_...` SIGKILLs
a real chief process.
"""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import tensorflow as tf

import tf_distbelief as tfdb
from tests.fixtures import launch
from tests.fixtures.sandblaster import (
    _VALUE,
    CE,
    EQUAL_PORTIONS,
    _digits_train,
    _latest_iteration,
    _logistic_model,
    _relative_errors,
)
from tf_distbelief import demos, job, paths, sandblaster
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.faults import resume
from tf_distbelief.sandblaster import checkpoint
from tf_distbelief.sandblaster import config as config_lib


def _strategy(local_cluster, num_workers, num_ps):
    return strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=num_workers, num_ps=num_ps)
    )


def _trainer(strategy, history, model=None):
    x, y = _digits_train()
    return sandblaster.SandblasterTrainer(
        strategy,
        model or _logistic_model(),
        CE,
        x,
        y,
        portions=EQUAL_PORTIONS,
        history=history,
    )


def _weights(trainer):
    return np.concatenate([w.ravel() for w in trainer.model.get_weights()])


def test_resumed_trainer_equals_uninterrupted(local_cluster, tmp_path):
    """12 iterations straight, against 5, a lost chief, then 7 more on 3 ps.

    `history=4`: the ring of `(s, y)` pairs is full and evicting when the
    chief is lost, so its order must come back from the checkpoint. The
    resumed run has 3 ps tasks where the first had 2 (each vector is
    resharded on restore), and one worker where it had two.
    """
    total, stop_at, history = 12, 5, 4
    straight = _trainer(_strategy(local_cluster, 2, 2), history)
    reference = straight.fit(max_iters=total, record_iterates=True)
    reference_weights = _weights(straight)
    straight.objective.close()

    model_dir = str(tmp_path)
    first = _trainer(_strategy(local_cluster, 2, 2), history)
    part = first.fit(max_iters=stop_at, record_iterates=True, model_dir=model_dir)
    first.objective.close()
    assert part.num_iters == stop_at

    lines = []
    strategy = _strategy(local_cluster, 1, 3)
    resumed = _trainer(strategy, history)
    rest = resumed.fit(
        max_iters=total,
        record_iterates=True,
        model_dir=model_dir,
        print_fn=lines.append,
    )
    assert re.fullmatch(
        rf"Resumed L-BFGS from .*/sandblaster/ckpt-{stop_at} at iteration {stop_at} "
        r"\(loss [0-9.]+\)",
        lines[0],
    ), lines
    assert rest.num_iters == total and len(rest.x.shards) == 3
    iterates = part.iterate_history + rest.iterate_history[1:]
    errors = _relative_errors(iterates, reference.iterate_history)
    assert len(errors) == total + 1 and max(errors) <= 1e-9, errors
    np.testing.assert_allclose(rest.loss_history, reference.loss_history, rtol=1e-12)
    assert rest.num_evals == reference.num_evals
    assert max(_relative_errors([_weights(resumed)], [reference_weights])) <= 1e-9
    # Only the evaluations after the checkpoint ran again.
    assert resumed.stats.evaluations == reference.num_evals - part.num_evals

    # Every iteration wrote one; the manager keeps the last 3, the user's file stays.
    (tmp_path / "notes.txt").write_text("mine")
    directory = pathlib.Path(paths.sandblaster_dir(str(tmp_path)))
    latest = tf.train.latest_checkpoint(str(directory))
    assert latest.endswith(f"ckpt-{total}")
    assert sorted(p.name for p in directory.glob("ckpt-*.index")) == [
        f"ckpt-{k}.index" for k in (10, 11, 12)
    ]
    reader = tf.train.load_checkpoint(latest)
    np.testing.assert_array_equal(
        reader.get_tensor("x" + _VALUE), rest.iterate_history[-1]
    )
    assert reader.get_tensor("num_iters" + _VALUE) == total
    assert reader.get_tensor("rho_history" + _VALUE).shape == (history,)
    # Vector-free (the default): the dot products of the history and the
    # gradient are saved, so a resumed run reads the very bits.
    np.testing.assert_array_equal(reader.get_tensor("gram" + _VALUE), rest.state.gram)
    assert rest.state.gram.shape == (2 * history + 1, 2 * history + 1)

    # A rerun that asks for no more iterations evaluates nothing.
    lines.clear()
    again = _trainer(strategy, history)
    done = again.fit(max_iters=total, model_dir=model_dir, print_fn=lines.append)
    assert f"at iteration {total}" in lines[0]
    assert done.num_iters == total and again.stats.evaluations == 0
    np.testing.assert_array_equal(done.state.gram, rest.state.gram)
    np.testing.assert_array_equal(_weights(again), _weights(resumed))
    assert (tmp_path / "notes.txt").read_text() == "mine"

    # A checkpoint of another memory or model is an error naming it; nothing
    # is written or changed.
    with pytest.raises(
        resume.RestoreError,
        match=r"`history`: 4 \(s, y\) pairs in the checkpoint, 5 here .*"
        r"--lbfgs_history=4",
    ):
        _trainer(strategy, 5).fit(model_dir=model_dir)
    with pytest.raises(
        resume.RestoreError,
        match=r"weight 0: `dense\S*/kernel:0 \(64, 10\) float64` in the checkpoint, "
        r"`dense\S*/kernel:0 \(64, 10\) float32` here",
    ):
        _trainer(strategy, history, _logistic_model("float32")).fit(model_dir=model_dir)
    assert tf.train.latest_checkpoint(str(directory)) == latest

    # A state holding NaN is never written; the last checkpoint stays.
    checkpointer = checkpoint.LbfgsCheckpointer(
        again.objective.ops,
        str(directory),
        history=history,
        model=checkpoint.describe_model(again.objective.layout.variables),
    )
    state = checkpointer.restore(like=again.objective.grad)
    state.num_iters += 1
    state.loss_history.append(state.loss)
    state.step_history.append(1.0)
    state.s_history[2].shards[1].assign(
        tf.fill(state.s_history[2].shards[1].shape, np.float64(np.nan))
    )
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Refusing to write an L-BFGS checkpoint at iteration 13: "
        r"s_history/2 hold NaN or inf. Nothing was written; the last checkpoint, "
        r".*ckpt-12, is kept",
    ):
        checkpointer.save(state)
    assert tf.train.latest_checkpoint(str(directory)) == latest
    again.objective.close()


@pytest.mark.slow
def test_vector_free_resumes_a_checkpoint_of_the_two_loop_on_vectors(
    local_cluster, tmp_path
):
    """A checkpoint without `gram` (written by `two_loop="vectors"`, or before
    vector-free L-BFGS): the vector-free run rebuilds the dot products from
    the restored vectors with one `gram` call. Rebuilt by a matmul of another
    shape, they may differ from the incremental ones in the last bits, which
    L-BFGS here carries as rounding: 1e-9 holds."""
    total, stop_at, history = 10, 4, 3
    x, y = _digits_train()

    def trainer(two_loop):
        config = config_lib.SandblasterConfig(
            history=history, portions=EQUAL_PORTIONS, two_loop=two_loop
        )
        return sandblaster.SandblasterTrainer(
            _strategy(local_cluster, 2, 2), _logistic_model(), CE, x, y, config
        )

    straight = trainer("vector_free")
    reference = straight.fit(max_iters=total, record_iterates=True)
    straight.objective.close()
    first = trainer("vectors")
    part = first.fit(max_iters=stop_at, record_iterates=True, model_dir=str(tmp_path))
    first.objective.close()
    reader = tf.train.load_checkpoint(
        tf.train.latest_checkpoint(str(tmp_path / "sandblaster"))
    )
    assert "gram" + _VALUE not in reader.get_variable_to_shape_map()

    resumed = trainer("vector_free")
    ops = resumed.objective.ops
    ops.round_trips.clear()
    rest = resumed.fit(
        max_iters=total, record_iterates=True, model_dir=str(tmp_path), print_fn=len
    )
    evaluations = rest.num_evals - part.num_evals
    # The rebuild, then one per iteration and one per evaluation.
    assert ops.round_trips["gram"] == 1 + (total - stop_at) + evaluations
    iterates = part.iterate_history + rest.iterate_history[1:]
    errors = _relative_errors(iterates, reference.iterate_history)
    assert len(errors) == total + 1 and max(errors) <= 1e-9, errors
    assert rest.num_evals == reference.num_evals
    resumed.objective.close()


def test_job_path_resumes_and_ends_at_the_requested_iteration(local_cluster, tmp_path):
    """`job.train` again with the same `model_dir`: what a recovering chief does.

    The first call stops after 4 iterations (as if the chief were lost after
    its checkpoint); the second goes on to 7 in all, not 4 + 7.
    """
    spec = demos.spec("digits")

    def train(max_iters, lines):
        config = job.JobConfig(
            optimizer="lbfgs",
            model_dir=str(tmp_path),
            sandblaster=config_lib.SandblasterConfig(
                max_iters=max_iters, portions=8, checkpoint_every_iters=2
            ),
        )
        resolver = local_cluster.resolver_for(num_workers=2, num_ps=2)
        return job.train(config, spec, resolver, print_fn=lines.append)

    first_lines, second_lines = [], []
    first = train(4, first_lines)
    assert first["iterations"] == 4
    assert not any(line.startswith("Resumed") for line in first_lines)
    second = train(7, second_lines)
    assert re.match(r"Resumed L-BFGS from .*ckpt-4 at iteration 4 ", second_lines[0])
    assert second["iterations"] == 7
    directory = pathlib.Path(paths.sandblaster_dir(str(tmp_path)))
    # Every 2nd iteration and the last: 2, 4 (first run), 6, 7 (second run).
    assert sorted(p.name for p in directory.glob("ckpt-*.index")) == [
        f"ckpt-{k}.index" for k in (4, 6, 7)
    ]
    assert second["test_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.xdist_group("lbfgs_digits_reference")
def test_launch_sigkilled_chief_reruns_to_the_uninterrupted_result(
    lbfgs_digits_reference, tmp_path
):
    """`train.py --optimizer=lbfgs --model_dir=D`, SIGKILL of the chief, rerun.

    The uninterrupted reference runs the same job in this process (`job.train`
    on the shared cluster, 2 workers and 2 ps as `train.py` starts;
    `conftest.lbfgs_digits_reference`, which tests/faults/test_ps_recovery.py's
    Sandblaster test shares). The digits model is float32 (its objective is
    computed in float32 at the float64 parameter vector) and evaluated
    deterministically, so the rerun's final parameter vector, loss and step
    histories, read from the last checkpoints, equal the reference's to 1e-9.
    """
    total = launch.LBFGS_REFERENCE_ITERS
    args = [
        "--model=digits",
        "--optimizer=lbfgs",
        f"--portions={launch.LBFGS_REFERENCE_PORTIONS}",
        f"--lbfgs_max_iters={total}",
        "--num_workers=2",
        "--num_ps=2",
    ]
    killed_dir = str(tmp_path / "killed")

    marker = uuid.uuid4().hex
    chief = subprocess.Popen(
        [sys.executable, launch.TRAIN, *args, f"--model_dir={killed_dir}"],
        env=launch._env(marker),
        cwd=launch.ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        checkpoints = paths.sandblaster_dir(killed_dir)
        deadline = time.monotonic() + 300
        while _latest_iteration(checkpoints) < 3 and chief.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        chief.send_signal(signal.SIGKILL)
        assert chief.wait(30) == -signal.SIGKILL
    finally:
        chief.kill()
    assert launch._wait_no_marked(marker) == []
    killed_at = _latest_iteration(checkpoints)
    assert 3 <= killed_at < total

    output = launch._train_ok([*args, f"--model_dir={killed_dir}"])
    _resumed_to_the_reference(
        output, killed_at, total, checkpoints, lbfgs_digits_reference
    )


@pytest.mark.slow
@pytest.mark.xdist_group("lbfgs_digits_reference")
def test_launch_sigterm_saves_the_iteration_reached_and_reruns_to_the_reference(
    lbfgs_digits_reference, tmp_path
):
    """SIGTERM of the chief of `train.py --optimizer=lbfgs --model_dir=D`:
    the L-BFGS state of the iteration reached, past the last interval
    checkpoint (every 3 iterations here), saved within the grace period; the
    rerun resumes at that iteration and ends at the uninterrupted reference
    (`conftest.lbfgs_digits_reference`), as after a SIGKILL."""
    total = launch.LBFGS_REFERENCE_ITERS
    args = [
        "--model=digits",
        "--optimizer=lbfgs",
        f"--portions={launch.LBFGS_REFERENCE_PORTIONS}",
        f"--lbfgs_max_iters={total}",
        "--lbfgs_checkpoint_every_iters=3",
        "--num_workers=2",
        "--num_ps=2",
        f"--model_dir={tmp_path}",
    ]
    marker = uuid.uuid4().hex
    chief = subprocess.Popen(
        [sys.executable, launch.TRAIN, *args],
        env=launch._env(marker),
        cwd=launch.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        checkpoints = paths.sandblaster_dir(str(tmp_path))
        deadline = time.monotonic() + 300
        while _latest_iteration(checkpoints) < 3 and chief.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        sent = time.monotonic()
        chief.send_signal(signal.SIGTERM)
        output = chief.stdout.read()
        assert chief.wait(60) == 143, output[-3000:]
        assert time.monotonic() - sent < 25
    finally:
        chief.kill()
    assert launch._wait_no_marked(marker) == []
    found = re.search(
        r"^SIGTERM: job stopped at iteration (\d+), saved at the signal in "
        r"[\d.]+ s; a rerun resumes from ckpt-\1 \(iteration \1\)$",
        output,
        re.M,
    )
    assert found, output[-3000:]
    stopped_at = int(found.group(1))
    assert 3 < stopped_at < total
    assert _latest_iteration(checkpoints) == stopped_at

    output = launch._train_ok(args)
    _resumed_to_the_reference(
        output, stopped_at, total, checkpoints, lbfgs_digits_reference
    )


def _resumed_to_the_reference(output, at, total, checkpoints, reference):
    """Checks a rerun's `output`: resumed at iteration `at`, ended at `total`
    with the uninterrupted `reference` run's iterate and histories (1e-9)."""
    assert re.search(
        rf"^Resumed L-BFGS from .*ckpt-{at} at iteration {at} ", output, re.M
    ), output[-3000:]
    assert re.search(rf"^lbfgs: {total} iterations", output, re.M)
    want = tf.train.load_checkpoint(tf.train.latest_checkpoint(reference))
    got = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoints))
    for key in ("x", "loss_history", "step_history"):
        a, b = got.get_tensor(key + _VALUE), want.get_tensor(key + _VALUE)
        assert a.shape == b.shape, key
        assert _relative_errors([a], [b])[0] <= 1e-9, key
    assert got.get_tensor("num_iters" + _VALUE) == total
