"""Saving at a preemption signal: a whole checkpoint within a grace period, or none.

A scheduler stops a job with a signal, then waits a grace period before
SIGKILL (Kubernetes: SIGTERM and 30 s by default; Slurm: SIGTERM, or the
signal of `--signal`). The launch script's chief arms a `Preemption`
(`job.stopping`) and its signal handler calls `Preemption.request`, which only
records the signal. The trainer that runs sees the request at its next step
boundary (`requested`; tf_keras `fit`'s `Checkpointer`, `keras3.fit`'s
epochs, Sandblaster's iteration callback), waits for the steps in flight
(each applied once: `exactly_once`; those not started are cancelled, the
trainer's `cancel`), writes the checkpoint of the step reached with the job's
one writer (`resume.save_whole`) and ends the job (`save_and_stop`): a rerun
with the same flags redoes no step.

A save that does not finish within the grace period is abandoned whole: at the
deadline the armed preemption's watchdog closes the commit gate (`commit`: no
checkpoint write records itself as the latest after that), removes what the
write in progress left (`writing`), and ends the job, the previous checkpoint
still the latest. TensorFlow writes a checkpoint's files first and points the
`checkpoint` state file at it last (a temporary file, renamed), so what a
rerun resumes from is always whole.

A trainer that can save at the signal says so for as long as it trains
(`saving`); a signal that comes while none does (the cluster starting, the
test accuracy) stops the job at once, as SIGINT does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from tf_distbelief import console

# The armed preemption of this process (`arm`), or None.
_armed: Preemption | None = None
# The trainers running that save at the signal (`saving`): `(save, cancel)`.
_savers: list[tuple[Callable[[], tuple[int, bool]], Callable[[], None] | None]] = []


class _SaveAbandonedError(RuntimeError):  # Caught by `resume.save_whole`.
    """A checkpoint write came to its commit after the grace period ended."""


class Preemption:
    """The save at a signal, armed before training (see the module).

    Args:
      grace_secs: seconds from the signal to the end of the job, > 0.
      stop: `(what) -> None`, ends the job after printing `what` (one line,
        completed with what a rerun resumes from); called once, from the
        thread that saved, or the watchdog's.

    Attributes:
      grace_secs: as given.
      name: the signal's name once requested (`SIGTERM`), else None.
      received: when it was requested, on `time.monotonic`'s scale.
    """

    def __init__(self, grace_secs: float, stop: Callable[[str], None]):
        self.grace_secs = grace_secs
        self.name: str | None = None
        self.received: float | None = None
        self._stop = stop
        self._lock = threading.Lock()  # Never taken by `request`.
        self._signalled = threading.Event()
        self._cancelled = threading.Event()  # The trainer's `cancel` has run.
        self._abandoned = False
        self._finished = False
        self._cleanup: Callable[[], None] | None = None
        # Started now, not in the signal handler: a thread started there could
        # wait on a lock the interrupted main thread holds.
        threading.Thread(
            target=self._watch, name="tfdb-preemption-grace", daemon=True
        ).start()

    def request(self, name: str) -> None:
        """Records signal `name` (from a signal handler: takes no lock)."""
        self.received = time.monotonic()
        self.name = name
        self._signalled.set()

    @property
    def pending(self) -> bool:
        """Whether a signal was requested and the job has not ended yet."""
        return self.name is not None and not self._finished and not self._abandoned

    @property
    def abandoned(self) -> bool:
        """Whether the grace period ended before the save (the job is ending)."""
        return self._abandoned

    def _watch(self) -> None:
        self._signalled.wait()
        # The steps not started yet are cancelled from here, not from the
        # signal handler: it could interrupt the main thread holding the
        # coordinator's queue lock.
        savers = list(_savers)  # The trainer may end meanwhile.
        cancel = savers[-1][1] if savers else None
        try:
            if cancel is not None:
                cancel()
        finally:
            self._cancelled.set()
        time.sleep(max(0.0, self.received + self.grace_secs - time.monotonic()))
        with self._lock:
            if self._finished:
                return
            self._abandoned = True
            cleanup = self._cleanup
        if cleanup is not None:
            cleanup()
        self._stop(
            f"{self.name}: job stopped; the save at the signal did not finish "
            f"within --preemption_grace_secs={self.grace_secs:g} and was "
            "abandoned, nothing of it kept"
        )

    def _finish(self) -> bool:
        """Ends the grace period's watch; False when the watchdog abandoned."""
        with self._lock:
            if self._abandoned:
                return False
            self._finished = True
            return True

    def save_and_stop(
        self, save: Callable[[], tuple[int, bool]], unit: str = "step"
    ) -> None:
        """Saves the step reached and ends the job (`stop`); see `save_and_stop`."""
        self._cancelled.wait(self.grace_secs)
        try:
            step, written = save()
        except Exception as error:  # noqa: BLE001  (the job stops either way)
            what = (
                f"job stopped; the save at the signal failed ({type(error).__name__}"
                f": {console.shorten(str(error), 300)})"
            )
        else:
            secs = time.monotonic() - self.received
            if written:
                what = (
                    f"job stopped at {unit} {step}, saved at the signal in {secs:.1f} s"
                )
            elif step == 0:  # Signalled before the first step, or in it.
                what = f"job stopped before its first {unit} ended"
            else:
                what = f"job stopped at {unit} {step}, its checkpoint already written"
        if not self._finish():
            threading.Event().wait()  # The watchdog ends the job.
        self._stop(f"{self.name}: {what}")

    def stop_unsaved(self, why: str) -> None:
        """Ends the job without a save at the signal, saying `why`."""
        if self._finish():
            self._stop(f"{self.name}: job stopped, not saved at the signal ({why})")

    def commit(self, record: Callable[[], None]) -> None:
        """`record()` unless the grace period ended; see `commit`."""
        with self._lock:
            if self._abandoned:
                raise _SaveAbandonedError(
                    f"the grace period after {self.name} "
                    f"(--preemption_grace_secs={self.grace_secs:g}) ended first"
                )
            record()

    @contextlib.contextmanager
    def writing(self, cleanup: Callable[[], None]):
        """See `writing`."""
        self._cleanup = cleanup
        try:
            yield
        finally:
            self._cleanup = None


def arm(grace_secs: float, stop: Callable[[str], None]) -> Preemption:
    """Arms this process's `Preemption` (the launch script's chief); returns it."""
    global _armed
    _armed = Preemption(grace_secs, stop)
    return _armed


def disarm() -> None:
    """Forgets the armed `Preemption` (a library caller's process, a test)."""
    global _armed
    _armed = None


def armed() -> Preemption | None:
    """The armed `Preemption`, or None."""
    return _armed


@contextlib.contextmanager
def saving(
    save: Callable[[], tuple[int, bool]],
    cancel: Callable[[], None] | None = None,
    cancelled: tuple[type[BaseException], ...] = (),
    unit: str = "step",
):
    """While the block runs, a signal asks `save` for a checkpoint (see `arm`).

    The trainer inside checks `requested` at each step boundary; a request
    that comes after its last check is answered when the block ends. An
    exception ends the job unsaved, unless it is one of `cancelled` (a wait
    for a step that `cancel` cancelled): then `save` runs.

    Args:
      save: `() -> (step, written)`: waits for the steps in flight and writes
        the checkpoint of the step reached; `written` is False when the
        latest checkpoint already holds that step.
      cancel: None, or what cancels the steps scheduled but not started, run
        from another thread as soon as the signal comes, so that the save
        waits only for the steps in flight.
      cancelled: the exception classes a wait for a cancelled step raises.
      unit: what `save`'s number counts, for the line (`iteration`:
        Sandblaster's L-BFGS).
    """
    entry = (save, cancel)
    _savers.append(entry)
    try:
        yield
    except BaseException as error:
        if _armed is not None and _armed.abandoned:
            # What a write refused at the commit gate raises: the watchdog
            # ends the job (one line, 128 + the signal), not this error.
            threading.Event().wait()
        if not requested():
            raise
        if not isinstance(error, cancelled):
            _armed.stop_unsaved(f"training raised {type(error).__name__}")
            raise
    finally:
        _savers.remove(entry)
    save_and_stop(save, unit)


def can_save() -> bool:
    """Whether a trainer that saves at the signal is running (`saving`)."""
    return bool(_savers)


def requested() -> bool:
    """Whether a signal asks the trainer to save and stop now."""
    return _armed is not None and _armed.pending


def save_and_stop(save: Callable[[], tuple[int, bool]], unit: str = "step") -> None:
    """Saves the step reached and ends the job (the armed `Preemption`'s `stop`).

    Returns only when nothing is requested (`requested` is False). If the
    watchdog abandons the save first, this thread waits for it to end the
    job.

    Args:
      save: as `saving`'s.
      unit: as `saving`'s.
    """
    if requested():
        _armed.save_and_stop(save, unit)


def commit(record: Callable[[], None]) -> None:
    """Runs `record` (a checkpoint made the latest) unless the save was abandoned.

    Raises:
      _SaveAbandonedError: the grace period ended first; nothing recorded.
    """
    if _armed is None:
        record()
    else:
        _armed.commit(record)


def writing(cleanup: Callable[[], None]):
    """A context: while it writes a checkpoint, an abandoned save calls
    `cleanup` (removing what the write left)."""
    if _armed is None:
        return contextlib.nullcontext()
    return _armed.writing(cleanup)
