"""`ClusterCoordinator` internals: its threads, its failure handler, its queue,
and the per-worker resources it creates.

Used by `strategy` (waiting before a new strategy connects; keeping
per-worker resources while connected), by
`cluster.local` (a lost task's reconnect finished, and the failure handlers
stopped, before leaving the tasks), by
`keras3.training` (a failed closure cancels those queued behind it), by
`faults.step_watch` (a step limit on the coordinator's closures) and by
`faults.tf_keras_fit` (a preemption's save cancels the steps not started).
"""

from __future__ import annotations

import collections
import contextlib
import queue as queue_lib
import sys
import threading
import time
from collections.abc import Iterator

from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

from tf_distbelief.tf_internals import _shapes

# The newest per-worker resources kept, at most this many: a job makes one
# per `fit` (its iterator). Few: the coordinator creates every live one anew
# on a worker that rejoins.
MAX_KEPT_PER_WORKER_RESOURCES = 4
_KEPT_LOCK = threading.Lock()
_KEPT: collections.deque = collections.deque()

# Where a coordinator thread waits when it has nothing to do: `(loop, idle)`,
# the loop's function and the one it calls to wait.
_IDLE_WAITS = (("_process_queue", "get"), ("_preemption_handler", "wait"))
# The failure handlers of TensorFlow 2.21's coordinator.
_HANDLER_CLASSES = (cc.WorkerPreemptionHandler, cc.CoordinationServicePreemptionHandler)
# Between two looks at reconnecting failure handlers.
_RECONNECT_POLL_SECS = 0.05


def busy_coordinator_threads(handlers=None) -> list[str]:
    """Names of `ClusterCoordinator` threads with work in flight.

    A coordinator's worker thread waits in `_CoordinatedClosureQueue.get` when
    idle and its failure handler waits on an event; a thread anywhere else in
    those loops is creating a per-worker resource (variable, iterator),
    running a scheduled function, or reconnecting a worker. A new strategy
    connecting while one is busy crashed the process (SIGSEGV in the eager
    runtime). Public route checked: `ClusterCoordinator.join` waits for
    scheduled functions only, not for resource creation or recovery.

    Args:
      handlers: None: every coordinator's threads; else only the threads of
        the coordinators with one of these failure handlers.
    """
    frames = sys._current_frames()
    busy = []
    for thread in threading.enumerate():
        if handlers is not None and _failure_handler_of(thread) not in handlers:
            continue
        frame, stack = frames.get(thread.ident), []
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back
        for loop, idle in _IDLE_WAITS:
            if loop in stack:
                i = stack.index(loop)
                if i == 0 or stack[i - 1] != idle:
                    busy.append(thread.name)
    return busy


def _failure_handler_of(thread):
    """The failure handler of the coordinator whose thread `thread` is, or None."""
    owner = getattr(getattr(thread, "_target", None), "__self__", None)
    if isinstance(owner, cc.Worker):
        return owner.failure_handler
    return owner if isinstance(owner, _HANDLER_CLASSES) else None


def reconnecting_failure_handlers(addresses) -> list:
    """The failure handlers of a cluster holding one of `addresses` that are
    reconnecting a lost task: each keeps calling `update_server_def`, whose
    first call (`GetStatus`) waits for every task of its cluster to answer,
    without a bound; with the task gone for good, the handler and the worker
    threads waiting for it (`wait_on_failure`) stay busy for ever. Public
    route checked: none; `ClusterCoordinator` does not say it is recovering."""
    return [
        handler
        for handler in _failure_handlers(addresses)
        if handler._should_preemption_thread_run
        and handler._cluster_due_for_update_or_finish.is_set()
    ]


def stop_closure_queues(handlers) -> None:
    """Stops the closure queues of the coordinators of `handlers`.

    What `Cluster.stop` does to the queue (queued closures left unrun, those
    in flight cancelled, each worker thread ending at its next `get`), without
    `Cluster.stop`'s wait for the failure handler's lock, which a handler
    reconnecting a task gone for good holds for ever. For a cluster being
    ended: its queued work (a lost worker's closures put back) is not run on
    a task started again only to end a reconnect. Public route checked:
    `ClusterCoordinator` has no public stop.
    """
    for handler in handlers:
        handler._cluster.closure_queue.stop()


def wait_until_reconnected(handlers, timeout_secs: float) -> bool:
    """Waits until none of `handlers` is reconnecting and their coordinators'
    threads are idle (a worker thread that got its worker back creates its
    per-worker resources anew), at most `timeout_secs`.

    Returns:
      True if they are; False at the deadline.
    """
    deadline = time.monotonic() + timeout_secs
    while any(h._cluster_due_for_update_or_finish.is_set() for h in handlers) or (
        busy_coordinator_threads(handlers)
    ):
        if time.monotonic() > deadline:
            return False
        time.sleep(_RECONNECT_POLL_SECS)
    return True


def _failure_handlers(addresses) -> list:
    """The failure handlers of this process's live `ClusterCoordinator`s (the
    objects whose `_preemption_handler` loop a running thread runs) whose
    cluster holds one of `addresses`."""
    addresses = set(addresses)
    handlers = []
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)  # Kept while the thread runs.
        if getattr(target, "__name__", None) != "_preemption_handler":
            continue
        handler = target.__self__
        cluster = handler._server_def.cluster
        if any(a in addresses for job in cluster.job for a in job.tasks.values()):
            handlers.append(handler)
    return handlers


@contextlib.contextmanager
def failure_handlers_stopped(addresses, timeout_secs: float) -> Iterator[bool]:
    """Stops the failure handlers of a cluster's coordinators, holding their locks.

    A failure handler reconnects a lost worker by calling `update_server_def`
    under its `_cluster_update_lock`, again and again until the worker is back
    (for ever, if it never is). Another `update_server_def` beside it crashed
    the process (SIGSEGV in the eager runtime). Inside this context no handler
    updates the server def, and none will after it: each is told to stop (what
    `WorkerPreemptionHandler.stop` does, but with a bounded wait for the lock).
    Public route checked: `ClusterCoordinator` has no public stop; its
    `_cluster.stop()` waits for the lock without a bound.

    Only the coordinators whose cluster holds one of `addresses` (the tasks
    about to be left): other clusters' coordinators in the process (a test
    suite's shared cluster) keep recovering their workers.

    Args:
      addresses: `host:port` of the tasks about to be left.
      timeout_secs: the most seconds to wait for the handlers' locks, in all
        (a handler holds its lock while one `update_server_def` runs).

    Yields:
      True if every handler's lock is held; False if one was still busy after
      `timeout_secs` (the others are held and stopped all the same; the busy
      one ends once its `update_server_def` returns).
    """
    deadline = time.monotonic() + timeout_secs
    held, all_held = [], True
    for handler in _failure_handlers(addresses):
        # Told first, as `stop` does: a handler still busy at the deadline
        # ends after its `update_server_def` instead of trying again.
        handler._should_preemption_thread_run = False
        lock = handler._cluster_update_lock
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            all_held = False
            continue
        held.append(lock)
        handler._cluster_due_for_update_or_finish.set()
    try:
        yield all_held
    finally:
        for lock in reversed(held):
            lock.release()


def worker_recovery_pending(strategy) -> bool:
    """True while `strategy`'s coordinator is reconnecting a failed worker.

    Its failure handler keeps calling `update_server_def` with this strategy's
    cluster until the worker is back; a new strategy connecting meanwhile is
    reconfigured under it. Public route checked: none.
    """
    coordinator = getattr(strategy, "_cluster_coordinator", None)
    if coordinator is None:
        return False
    handler = coordinator._cluster.failure_handler
    return handler._cluster_due_for_update_or_finish.is_set()


def cancel_queued_on_failure(coordinator) -> None:
    """Makes a failed closure cancel the closures queued behind it at once.

    TensorFlow's closure queue records a closure's error (`mark_failed`) and
    cancels the queued closures only when the user thread next calls
    `schedule`, `join` or `done` (`_raise_if_error`). Meanwhile each worker
    thread takes the next closure: a step scheduled after a step that failed
    (a NaN refused with `nonfinite="raise"`) still ran and updated the ps,
    about one time in three on a loaded machine. Used for `keras3.fit` only:
    Sandblaster's recovery from a lost ps reads the queued portions' errors.
    Here `mark_failed` also takes
    every queued closure off the queue and marks it cancelled, under the
    queue's lock, as `_cancel_all_closures` would; closures in flight on
    other workers run on (TensorFlow cancels them at the user thread's next
    call). Idempotent. Public route checked: none; `ClusterCoordinator` has no
    hook on a closure's failure.

    Args:
      coordinator: a `tf.distribute.experimental.coordinator.ClusterCoordinator`.
    """
    closures = coordinator._cluster.closure_queue
    if getattr(closures, "_tfdb_cancels_on_failure", False):
        return
    mark_failed = closures.mark_failed

    def mark_failed_and_cancel_queued(error):
        mark_failed(error)
        with closures._queue_lock:
            _cancel_queued_locked(closures)

    closures.mark_failed = mark_failed_and_cancel_queued
    closures._tfdb_cancels_on_failure = True


def cancel_queued(coordinator) -> int:
    """Cancels the closures queued on `coordinator` that no worker has started.

    For a preemption's save (`faults.preemption`): tf_keras `fit` schedules
    a whole epoch (or up to the next interval checkpoint) ahead, far more
    than a grace period may allow to run. The closures still queued are taken
    off the queue and marked cancelled, under the queue's lock, as
    `_cancel_all_closures` does; those in flight run on (`join` waits for
    them), so each step runs whole or not at all. Public route checked: none;
    `ClusterCoordinator` cancels only on a closure's error.

    Args:
      coordinator: a `tf.distribute.experimental.coordinator.ClusterCoordinator`.

    Returns:
      How many closures were cancelled (queued ones, in order: the last
      scheduled).
    """
    closures = coordinator._cluster.closure_queue
    with closures._queue_lock:
        cancelled = _cancel_queued_locked(closures)
        # A `join` waiting on an empty queue and no closure in flight.
        closures._stop_waiting_condition.notify_all()
    return cancelled


def _cancel_queued_locked(closures) -> int:
    """Takes every queued closure off `closures` (a `_CoordinatedClosureQueue`,
    its `_queue_lock` held by the caller) and marks it cancelled, freeing its
    slot, as `_cancel_all_closures` does; returns how many."""
    cancelled = 0
    while True:
        try:
            closure = closures._queue.get(block=False)
        except queue_lib.Empty:
            return cancelled
        closures._queue_free_slot_condition.notify()
        closure.mark_cancelled()
        cancelled += 1


class _CountingWatchDog:  # The queue's `WatchDog`, counting finished closures.
    def __init__(self, inner):
        self.inner, self.finished = inner, 0

    def report_closure_done(self):
        self.finished += 1
        self.inner.report_closure_done()

    def __getattr__(self, name):  # `stop`, and any other the queue calls.
        return getattr(self.inner, name)


class CoordinatorProgress:
    """A `ClusterCoordinator`'s closures: finished, waiting; `fail` stops waits.

    For `step_watch`: the queue's `WatchDog` (told of each closure finished by
    `mark_finished`) is wrapped to count them; `fail` sets the error as a failed
    closure's `mark_failed` does (the waiting `schedule` or `join` raises it) and
    cancels the queued closures (frees a `schedule` blocked on a full queue).
    Public route checked: `ClusterCoordinator.done` only says whether all are
    finished. `of(strategy)`: None before the strategy has a coordinator.
    """

    @classmethod
    def of(cls, strategy) -> CoordinatorProgress | None:
        coordinator = getattr(strategy, "_cluster_coordinator", None)
        return None if coordinator is None else cls(coordinator)

    def __init__(self, coordinator):
        self._queue = queue = coordinator._cluster.closure_queue
        if not isinstance(queue._watchdog, _CountingWatchDog):
            queue._watchdog = _CountingWatchDog(queue._watchdog)
        self._counter = queue._watchdog

    finished = property(lambda self: self._counter.finished)  # Since first watched.

    def waiting(self) -> int:  # Closures queued or running.
        queue = self._queue
        return queue._queue.qsize() + queue.inflight_closure_count

    def fail(self, error: Exception, finished: int) -> bool:  # False: one finished.
        queue = self._queue
        with queue._queue_lock:  # `mark_finished` counts under it.
            if self._counter.finished != finished or not self.waiting():
                return False
            if queue._error is None:
                queue._error = error
            queue._stop_waiting_condition.notify_all()
            queue._cancel_all_closures()
        return True


class KeepingCoordinator(cc.ClusterCoordinator):
    """A `ClusterCoordinator` that keeps its per-worker datasets and iterators.

    A `fit` (tf_keras, Keras 3, Downpour) iterates a per-worker dataset
    (`create_per_worker_dataset`): one dataset iterator on each worker. When
    Python drops it, at the end of the `fit`, each worker deletes its
    iterator, and the deletion waits for the iterator's tf.data threads while
    holding the worker's remote tensor manager lock: seconds, during which the
    worker answers no TensorFlow call, so the chief's next request (the
    evaluation's functions) waits as long. This coordinator also references
    the newest `MAX_KEPT_PER_WORKER_RESOURCES` per-worker resources it
    creates, so a `fit` that ends does not delete them;
    `release_per_worker_resources` drops them once the tasks are left (a
    deletion then has no remote target). A job that makes more than the bound
    (a `fit` with `validation_data` makes one per evaluation) drops the
    oldest, whose deletion waits on the workers as before. The cost: a worker
    that rejoins gets every resource still referenced created anew
    (TensorFlow's `_on_worker_recovery`); hence the small bound.

    `DistBeliefStrategy` hands it out as its coordinator
    (`ClusterCoordinator(strategy)` returns the strategy's one instance), so
    TensorFlow's `ClusterCoordinator` class, and any other strategy's
    coordinator in the process, is left as TensorFlow defines it.

    Public route checked: none; `create_per_worker_dataset` has no option for
    it and tf_keras drops its data handler at the end of `fit`.
    `_create_per_worker_resources` is overridden (both
    `PerWorkerDataset.build` and `__iter__` create through it).
    """

    def _create_per_worker_resources(self, fn, args=None, kwargs=None):
        resources = super()._create_per_worker_resources(fn, args, kwargs)
        with _KEPT_LOCK:
            _KEPT.append(resources)
            oldest = None
            if len(_KEPT) > MAX_KEPT_PER_WORKER_RESOURCES:
                oldest = _KEPT.popleft()
        # Dropped outside the lock: deleting it may wait on its workers.
        del oldest
        return resources


def make_keeping_coordinator(strategy) -> KeepingCoordinator:
    """Makes `strategy`'s one coordinator a `KeepingCoordinator` and returns it.

    Call it before anything else makes the strategy's coordinator (TensorFlow
    makes one on the first `strategy.scope()`).

    Raises:
      TypeError: `strategy` already has a coordinator of another class.
    """
    coordinator = KeepingCoordinator(strategy)
    if not isinstance(coordinator, KeepingCoordinator):
        raise TypeError(
            "The strategy already has a ClusterCoordinator of class "
            f"{type(coordinator).__name__}; make the KeepingCoordinator first."
        )
    return coordinator


def kept_per_worker_resources() -> int:
    """How many per-worker resources the `KeepingCoordinator`s hold now."""
    with _KEPT_LOCK:
        return len(_KEPT)


def release_per_worker_resources() -> None:
    """Drops the per-worker resources kept (Python deletes those unused)."""
    with _KEPT_LOCK:
        kept = list(_KEPT)
        _KEPT.clear()
    del kept


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    queue = cc._CoordinatedClosureQueue
    names = {
        "_watchdog",
        "_queue",
        "_error",
        "_queue_lock",
        "_stop_waiting_condition",
        "_queue_free_slot_condition",
    }
    ok = names <= set(queue.__init__.__code__.co_names)
    ok = ok and callable(getattr(queue, "_cancel_all_closures", None))
    ok = ok and callable(getattr(queue, "mark_failed", None))
    ok = ok and callable(getattr(cc.Closure, "mark_cancelled", None))
    from tensorflow.python.distribute.coordinator import values

    creates = callable(
        getattr(cc.ClusterCoordinator, "_create_per_worker_resources", None)
    ) and all(
        "_create_per_worker_resources" in _shapes.code_names(method)
        for method in (
            values.PerWorkerDatasetFromDatasetFunction.build,
            values.PerWorkerDatasetFromDatasetFunction.__iter__,
        )
    )
    handlers = _HANDLER_CLASSES
    _shapes.expect(
        "coordinator",
        [
            (
                "_CoordinatedClosureQueue internals for step_watch, "
                "cancel_queued_on_failure and cancel_queued",
                ok,
            ),
            (
                "ClusterCoordinator.__new__ returns strategy._cluster_coordinator "
                "(one coordinator per strategy: make_keeping_coordinator)",
                "_cluster_coordinator"
                in cc.ClusterCoordinator.__new__.__code__.co_names,
            ),
            (
                "ClusterCoordinator._create_per_worker_resources, called by "
                "PerWorkerDataset build and __iter__",
                creates,
            ),
            (
                "Worker.failure_handler (the handler of a worker thread's "
                "coordinator: busy_coordinator_threads(handlers))",
                "failure_handler" in cc.Worker.__init__.__code__.co_names,
            ),
            (
                "failure handlers' _cluster.closure_queue.stop() (stop_closure_queues)",
                all(
                    "_cluster" in handler.__init__.__code__.co_names
                    for handler in handlers
                )
                and "closure_queue" in cc.Cluster.__init__.__code__.co_names
                and callable(getattr(queue, "stop", None)),
            ),
            (
                "Cluster.failure_handler._cluster_due_for_update_or_finish",
                "failure_handler" in cc.Cluster.__init__.__code__.co_names
                and all(
                    "_cluster_due_for_update_or_finish"
                    in handler.__init__.__code__.co_names
                    for handler in handlers
                ),
            ),
            (
                "failure handlers' _server_def, _cluster_update_lock, "
                "_should_preemption_thread_run (failure_handlers_stopped, "
                "reconnecting_failure_handlers)",
                all(
                    {
                        "_server_def",
                        "_cluster_update_lock",
                        "_should_preemption_thread_run",
                    }
                    <= set(handler.__init__.__code__.co_names)
                    for handler in handlers
                ),
            ),
            (
                "coordinator threads idle in Worker._process_queue (queue.get), "
                "_preemption_handler (event.wait)",
                callable(getattr(cc.Worker, "_process_queue", None))
                and callable(getattr(queue, "get", None))
                and all(
                    callable(getattr(handler, "_preemption_handler", None))
                    for handler in handlers
                ),
            ),
        ],
    )
