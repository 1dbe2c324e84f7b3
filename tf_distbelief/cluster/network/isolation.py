"""Network isolation of the local cluster: a private network namespace.

TensorFlow's gRPC servers (`tf.distribute.Server`, and the chief's own server)
bind every interface (`0.0.0.0` and `[::]`) whatever host the cluster spec
names, and run any op a client sends, unauthenticated: file reads and writes,
and so code execution as the job's user. TensorFlow has no bind-address option,
so the local job is kept off the network by where it runs instead:
`enter_private_network` re-executes the program, in the same process (same pid,
stdio, signals and exit status), under util-linux `unshare --user
--map-root-user --net`: a new user namespace (so no privilege is needed; the
user's uid is mapped to root inside and files are written as the user) with a
new network namespace holding only a loopback interface, which iproute2 `ip
link set lo up` brings up. Nothing of the job then listens in the host's
namespace; inside, the job has no network but its own loopback.

Where that is unavailable (not Linux, no `unshare` or `ip`, user namespaces
disabled, a process already running TensorFlow or threads, a `TF_CONFIG`
cluster, or turned off) the job runs as before and `LocalCluster` logs one
warning naming the risk and the ports (`warn_if_exposed`).

Example, first thing in a script that starts a `LocalCluster`:
  ```
  from tf_distbelief import cluster
  cluster.enter_private_network()  # Re-executes the script, or returns.
  ```
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from absl import logging

from tf_distbelief import console
from tf_distbelief.cluster import source

# Set in the environment of the re-executed program: the host's network
# namespace (`/proc/self/ns/net`). A process is inside the private namespace
# when it sees this variable and a different namespace of its own.
ENV_MARKER = "TFDB_ISOLATED_FROM_NETNS"
FLAG_NAME = "isolate_network"
# `ip` lives in /usr/sbin, which is not on an unprivileged user's PATH on Debian.
_EXTRA_PATH = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
# The probe forks two tiny programs; 10 s covers a heavily loaded machine.
_PROBE_TIMEOUT_SECS = 10.0
_PYTHON_API_REASON = (
    "a LocalCluster started from Python runs in the calling process's network "
    "namespace (call tf_distbelief.cluster.enter_private_network() "
    "first thing to isolate it)"
)
# Why the job is not isolated, for the warning (set by `enter_private_network`).
_exposed_reason = _PYTHON_API_REASON


@dataclasses.dataclass(frozen=True)
class Decision:
    """What `enter_private_network` does.

    Attributes:
      action: `"enter"` (re-execute in a private namespace), `"inside"` (this
        process is already in one) or `"exposed"` (run as is).
      reason: with `"exposed"`, why, for the warning; else empty.
    """

    action: str
    reason: str = ""


def find_tool(name: str) -> str | None:
    """Returns the path of program `name` on PATH or in the system folders."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_EXTRA_PATH])
    return shutil.which(name, path=path)


def _unshare_command(unshare: str) -> list[str]:
    return [unshare, "--user", "--map-root-user", "--net", "--"]


def probe(unshare: str, ip: str) -> str | None:
    """Tries the namespaces: `unshare ... --net ip link set lo up` in a child.

    Returns:
      None when it works, else the error (the first line of its output).
    """
    try:
        proc = subprocess.run(
            [*_unshare_command(unshare), ip, "link", "set", "lo", "up"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_SECS,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if proc.returncode == 0:
        return None
    lines = (proc.stderr + proc.stdout).strip().splitlines() or [""]
    cause = console.shorten(lines[0], 200)
    return f"`unshare --user --map-root-user --net` failed: {cause}"


def decide(
    *,
    requested: bool,
    inside: bool,
    tf_config_given: bool,
    platform: str,
    running: bool,
    unshare: str | None,
    ip: str | None,
    probe_fn: Callable[[str, str], str | None],
) -> Decision:
    """Decides whether to enter a private network namespace; pure but `probe_fn`.

    Args:
      requested: isolation asked for (`--isolate_network`, the default).
      inside: this process is already in a private namespace.
      tf_config_given: `TF_CONFIG`, or a JobSet's environment, names a cluster
        (its tasks must be reachable).
      platform: `sys.platform`.
      running: TensorFlow is imported, threads run, or the program is
        interactive or read from stdin (re-executing would redo or lose that
        work, e.g. a notebook's kernel).
      unshare, ip: the paths of util-linux `unshare` and iproute2 `ip`, or None.
      probe_fn: `probe`, called last, only when everything else allows.

    Returns:
      A `Decision`.
    """
    if inside:
        return Decision("inside")
    if not requested:
        return Decision("exposed", f"network isolation is off (--no{FLAG_NAME})")
    if tf_config_given:
        return Decision("exposed", "TF_CONFIG names a cluster")
    if not platform.startswith("linux"):
        return Decision("exposed", f"network namespaces need Linux ({platform})")
    if running:
        return Decision(
            "exposed",
            "the program is already running (TensorFlow imported, threads "
            "started, or an interactive session): isolate first thing in a script",
        )
    if unshare is None:
        return Decision("exposed", "no `unshare` program (util-linux) found")
    if ip is None:
        return Decision("exposed", "no `ip` program (iproute2) found")
    error = probe_fn(unshare, ip)
    if error is not None:
        return Decision("exposed", f"user/network namespaces unavailable: {error}")
    return Decision("enter")


def _netns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return None


def inside_private_network() -> bool:
    """Whether this process runs in the private namespace `enter_private_network`
    made (a child process inherits it)."""
    outer = os.environ.get(ENV_MARKER)
    return bool(outer) and _netns() not in (None, outer)


def _bring_up_loopback() -> None:
    ip = find_tool("ip")
    proc = subprocess.run(
        [ip or "ip", "link", "set", "lo", "up"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            "Could not bring up the loopback interface of the private network "
            f"namespace (`ip link set lo up`: {proc.stderr.strip()}). Rerun with "
            f"--no{FLAG_NAME} to run without network isolation."
        )


def enter_private_network(requested: bool = True) -> Decision:
    """Re-executes this program in a private network namespace, or returns.

    Call it first thing, before TensorFlow is imported and before any thread
    starts. The program (`sys.executable` with `sys.orig_argv`) is executed
    again in the same process: pid, open stdio, signal delivery and exit status
    are the caller's. In the re-executed program this call brings the
    namespace's loopback up and returns `Decision("inside")`.

    Args:
      requested: False to run without isolation (the warning then says so).

    Returns:
      `Decision("inside")`, or `Decision("exposed", reason)`; with `"enter"` it
      does not return. The reason is kept for `warn_if_exposed`.

    Raises:
      RuntimeError: inside, the loopback interface could not be brought up.
    """
    global _exposed_reason
    decision = decide(
        requested=requested,
        inside=inside_private_network(),
        tf_config_given=source.cluster_given(),
        platform=sys.platform,
        running="tensorflow" in sys.modules
        or threading.active_count() > 1
        or sys.argv[0] in ("", "-"),
        unshare=find_tool("unshare"),
        ip=find_tool("ip"),
        probe_fn=probe,
    )
    host_netns = _netns()
    if decision.action == "enter" and host_netns is None:
        decision = Decision("exposed", "/proc/self/ns/net is not readable")
    if decision.action == "inside":
        _bring_up_loopback()
    elif decision.action == "exposed":
        _exposed_reason = decision.reason
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        env = dict(os.environ, **{ENV_MARKER: host_netns})
        command = [*_unshare_command(find_tool("unshare")), sys.executable]
        os.execve(command[0], command + list(sys.orig_argv[1:]), env)
    return decision


def flag_value(argv: Sequence[str], default: bool = True) -> bool:
    """Reads `--[no]isolate_network` from `argv` before the full flag parse.

    The launch script decides before it imports TensorFlow, hence before absl
    parses its flags; absl parses this one flag here (other flags are left to
    the full parse, which also reports a bad value of this one).
    """
    from absl import flags

    values = flags.FlagValues()
    flags.DEFINE_bool(FLAG_NAME, default, "", flag_values=values)
    try:
        values(list(argv), known_only=True)
    except flags.Error:
        return False  # The full parse fails on it before anything starts.
    return values[FLAG_NAME].value


def warning_text(jobs: Mapping[str, Sequence[str]], reason: str) -> str:
    """The one-line warning for a cluster `{job: ["host:port", ...]}`."""
    ports = ", ".join(
        f"{job} {' '.join(a.rpartition(':')[2] for a in jobs[job])}"
        for job in ("chief", "worker", "ps")
        if jobs.get(job)
    )
    return (
        "tf_distbelief: the local cluster's TensorFlow servers listen on every "
        f"network interface, not only 127.0.0.1 (ports: {ports}), and run any op "
        "sent to them, unauthenticated: anyone who can reach these ports can run "
        f"code as this user. Not isolated: {reason}. Block the ports with a "
        "firewall or use a trusted network (README: Security)."
    )


def warn_if_exposed(jobs: Mapping[str, Sequence[str]]) -> bool:
    """Logs the warning unless this process is in a private namespace.

    Returns:
      Whether it warned.
    """
    if inside_private_network():
        return False
    logging.warning("%s", warning_text(jobs, _exposed_reason))
    return True
