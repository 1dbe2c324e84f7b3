"""Bytes on the sockets of one launcher job, by link (chief, worker, ps).

Runs the launcher (`python -m tf_distbelief.launch.train`) with the flags
after `tf-distbelief-train` in this script's arguments and reads the TCP
sockets of the job's processes every 0.2 s until it ends
(`traffic.read_sockets`, entering each task's network namespace), keeping
each connection's last count of bytes received. A connection is attributed
to the roles of the processes at its two ends (a task's role from its
`TF_CONFIG`, the launcher's process is the chief). Prints the job's
`downpour:` and `test accuracy` lines, then the bytes in all and per link,
each counted once (by the end that received them).

    python benchmarks/job_socket_bytes.py tf-distbelief-train --model=digits ...
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import traffic  # noqa: E402

POLL_SECS = 0.2
# The first argument: the launcher's name, so that the flags read as its own.
LAUNCHER = "tf-distbelief-train"


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from `/proc`."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children[parent].append(int(name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children[pid]
    return found


def role(pid: int) -> str | None:
    """`chief`, `worker` or `ps`: the task type of `TF_CONFIG` in the
    process's environment (`chief` without one); None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for entry in env:
        if entry.startswith(b"TF_CONFIG="):
            return json.loads(entry[len(b"TF_CONFIG=") :])["task"]["type"]
    return "chief"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != LAUNCHER:
        raise SystemExit(
            f"The first argument must be {LAUNCHER}, then its flags. "
            f"Received: {argv[:1]}"
        )
    command = [sys.executable, "-m", "tf_distbelief.launch.train", *argv[1:]]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    roles: dict[int, str] = {}
    received: dict[tuple, int] = {}  # (local, peer): bytes received.
    owners: dict = {}  # Endpoint: the roles of the processes holding it.
    while job.poll() is None:
        pids = descendants(job.pid)
        for pid in pids:
            if pid not in roles and (r := role(pid)) is not None:
                roles[pid] = r
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            for s in traffic.read_sockets(with_pids=True, pids=pids[1:]):
                key = (s.local, s.peer)
                received[key] = max(received.get(key, 0), s.bytes_received)
                if s.pids:
                    owners[s.local] = {roles.get(p, "?") for p in s.pids}
        time.sleep(POLL_SECS)
    reader.join(timeout=5)
    links = collections.Counter()
    for (local, peer), n in received.items():
        ends = sorted("+".join(sorted(owners.get(end, {"?"}))) for end in (local, peer))
        links["<->".join(ends)] += n
    for line in lines:
        if "downpour:" in line or line.startswith("test accuracy"):
            print(line.rstrip())
    print(f"exit status {job.returncode}")
    print(f"socket bytes: {sum(received.values()):,}")
    for link, n in sorted(links.items()):
        print(f"  {link}: {n:,}")
    return job.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
