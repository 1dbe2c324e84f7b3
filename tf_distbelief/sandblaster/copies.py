"""The copies of work portions in flight, each waited on with a bound (§4.2).

Dean et al. 2012, section 4.2. `objective.SandblasterObjective` schedules
every copy of a work portion (primary or backup task) with
`ClusterCoordinator.schedule` and books the first copy of each portion to
finish. `CopiesInFlight` holds the copies not yet booked: a daemon thread per
copy waits on its `RemoteValue`, so the coordinator can wait for the first of
any copies with public APIs, and every wait has a bound: a `RemoteValue`
whose workers are all gone never resolves (the coordinator requeues its
function until a worker is back), so waiting on it unbounded is a hang, and
a non-daemon thread left waiting on it keeps the process from exiting
(Python joins a `ThreadPoolExecutor`'s threads at exit).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

from absl import logging

from tf_distbelief import console
from tf_distbelief.sandblaster import schedule as schedule_lib

__all__ = ["Copy", "CopiesInFlight", "fetch_in_background"]


@dataclasses.dataclass
class Copy:
    """One scheduled copy of a work portion: its evaluation, ledger and slot."""

    eval_id: int
    ledger: schedule_lib.PortionLedger
    portion: int
    slot: int


def fetch_in_background(remote) -> concurrent.futures.Future:
    """`remote.fetch()` (a `RemoteValue`) in a daemon thread, as a `Future`."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def fetch():
        try:
            future.set_result(remote.fetch())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter.
            future.set_exception(e)

    threading.Thread(target=fetch, name="SandblasterCopyWait", daemon=True).start()
    return future


class CopiesInFlight:
    """The copies scheduled and not yet booked, in scheduling order."""

    def __init__(self):
        self._futures: dict[concurrent.futures.Future, Copy] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def add(self, remote, copy: Copy) -> None:
        """Starts waiting on `remote`, the `RemoteValue` of `copy`."""
        self._futures[fetch_in_background(remote)] = copy

    def pairs(self) -> list[tuple[int, int]]:
        """`(evaluation, portion)` of each copy in flight, sorted."""
        return sorted((c.eval_id, c.portion) for c in self._futures.values())

    def wait_first(
        self, timeout_secs: float, num_workers: int
    ) -> list[tuple[Copy, concurrent.futures.Future]]:
        """Waits for at least one copy to finish; removes and returns the finished.

        Args:
          timeout_secs: the longest wait, in seconds (`stall_timeout_secs`).
          num_workers: the workers, for the error message.

        Returns:
          `[(copy, future)]`: `future.result()` is the portion function's
          result, or raises its error.

        Raises:
          TimeoutError: none finished within `timeout_secs`, naming the
            copies waited for.
        """
        done, _ = concurrent.futures.wait(
            list(self._futures),
            timeout=timeout_secs,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        if not done:
            waiting = self.pairs()
            raise TimeoutError(
                f"Sandblaster: no copy of a work portion finished within "
                f"{timeout_secs:g} s (`stall_timeout_secs`, launch flag "
                f"--portion_stall_timeout_secs). Waited for "
                f"{len(waiting)} copies, (evaluation, portion): "
                f"{console.shorten(str(waiting))}, on {num_workers} workers. "
                "Check that the workers are up (the coordinator keeps a lost "
                "worker's portions queued until a worker can run them)."
            )
        return [(self._futures.pop(future), future) for future in done]

    def settle(self, timeout_secs: float) -> list[Copy]:
        """Waits at most `timeout_secs` for every copy; removes, returns the finished.

        After a failed evaluation, so that none is left running on the
        cluster behind the error (a caller stopping the cluster next would
        leave TensorFlow's coordinator retrying it against stopped tasks). A
        copy still running then stays in flight, named in a warning; its
        waiting thread is a daemon.
        """
        done, running = concurrent.futures.wait(list(self._futures), timeout_secs)
        finished = [self._futures.pop(future) for future in done]
        if running:
            logging.warning(
                "Sandblaster: %d copies of work portions still running %g s after "
                "the evaluation failed, (evaluation, portion): %s",
                len(running),
                timeout_secs,
                self.pairs(),
            )
        return finished
