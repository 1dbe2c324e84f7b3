"""A process's kernel counters: the fields of `/proc/<pid>/stat` (Linux).

The one reader of that file: the hung task watch knows a task's process by
its id and start time (`start_ticks`), so that it never kills another process
that got the same id; the goodput accountant dates the chief's start from it;
the benchmarks read a process's CPU time from it (`fields`).
"""

from __future__ import annotations

__all__ = ["CPU_FIELDS", "START_FIELD", "fields", "start_ticks"]

# Indices into `fields` (field 3 of proc(5), the state, is index 0): the
# clock ticks from boot to the process's start (field 22), and its user and
# system CPU time in clock ticks (fields 14 and 15).
START_FIELD = 19
CPU_FIELDS = (11, 12)


def fields(pid: int | str = "self") -> list[str]:
    """The fields of `/proc/<pid>/stat` after the command name, field 3 first.

    Args:
      pid: a process id, or `"self"`.

    Returns:
      The fields as strings (`START_FIELD`, `CPU_FIELDS` index them).

    Raises:
      OSError: no such process (`FileNotFoundError`), or no `/proc`.
    """
    name = "self" if pid == "self" else int(pid)
    with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) is in parentheses and may hold spaces.
    return stat[stat.rindex(b")") + 2 :].decode().split()


def start_ticks(pid: int | str = "self") -> int | None:
    """Clock ticks from boot to the start of process `pid`; None where it is
    gone or there is no `/proc`."""
    try:
        return int(fields(pid)[START_FIELD])
    except OSError:
        return None
