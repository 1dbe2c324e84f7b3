"""Child processes that die with the chief, whichever thread started them.

The local cluster's tasks and its hung task watch are the chief's children:
`set_parent_death_signal` (Linux's `PR_SET_PDEATHSIG`) has the kernel SIGKILL
such a child when its parent goes, and `popen_for_life` forks them from one
thread that lives as long as the chief, since the kernel sends that signal
when the forking *thread* ends.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import queue
import signal
import subprocess
import threading

__all__ = ["popen_for_life", "set_parent_death_signal"]


def set_parent_death_signal():
    """Child-side: SIGKILL this process when the parent dies (Linux only).

    Linux sends it when the *thread* that forked the child ends (prctl(2),
    PR_SET_PDEATHSIG), not only the process: start such children through
    `popen_for_life` so that a short-lived thread's restart of a task does
    not kill the task as soon as that thread returns.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class _Spawner:
    """One daemon thread that starts child processes and lives as long as this one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._thread = None

    def popen(self, args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="TaskProcessSpawner", daemon=True
                )
                self._thread.start()
        future = concurrent.futures.Future()
        self._requests.put((args, kwargs, future))
        return future.result()

    def _serve(self):
        while True:
            args, kwargs, future = self._requests.get()
            try:
                future.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's.
                future.set_exception(e)


_SPAWNER = _Spawner()


def popen_for_life(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, forked by a thread that never ends.

    With `preexec_fn=set_parent_death_signal`, the child then dies with this
    process, not with the thread that asked for it: the local cluster's
    supervisor thread, which returns once `max_restarts` are used up, and a
    test's `threading.Timer` restarting a task, used to take every task they
    had restarted down with them (SIGKILL) when they returned.

    Args:
      args, kwargs: as for `subprocess.Popen`.

    Returns:
      The started `subprocess.Popen`.

    Raises:
      What `subprocess.Popen` raises (OSError, ValueError).
    """
    return _SPAWNER.popen(args, **kwargs)
