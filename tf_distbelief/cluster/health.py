"""Whether a task answers: a TensorFlow server, a hung one, or nothing at all.

A TCP connect says only that something listens. A TensorFlow server that is
stopped (SIGSTOP, a swap storm) still accepts connections, its kernel
completing the handshake, and so does a port that is not a TensorFlow server
at all; TensorFlow then waits on it without a bound. `probe` makes a gRPC call
with a deadline and says which of three states the task is in.

The call is to a method no server registers (`_PROBE_METHOD`): gRPC itself
answers it (`UNIMPLEMENTED`) on the server's completion-queue threads, not on
its inter-op pool, so any answer means the process runs and serves gRPC. It
is deliberately not one of TensorFlow's own methods: TensorFlow runs
`WorkerService` calls such as `GetStatus`, and the eager service's requests,
on the task's inter-op thread pool, which TensorFlow's own work can hold for
tens of seconds on a live worker. Seen here, with stacks taken by gdb: at the
end of a `fit` the chief deletes the per-worker dataset iterators; on the
worker, the deletion waits for the iterator's tf.data threads while holding
the remote tensor manager's lock (4 to over 30 s), and the next eager request
waits for that lock: both pool threads of a 2-core machine were taken and
`GetStatus` went unanswered for as long, on a worker that then went on
training. A task whose process runs but whose ops are stuck (a stuck GPU
driver) still answers this probe: it is not restarted, and a job with no step
finished for the step watch's limit fails naming the workers.

`python -m tf_distbelief.cluster.health HOST:PORT` probes one task and exits
0 if it answers, 1 if not: a Kubernetes liveness probe for ps and worker pods
(`cluster.k8s.manifest`), so that the orchestrator restarts a hung task.

gRPC is TensorFlow's own transport (`grpcio` comes with `tensorflow`); the
request is empty and any answer within the deadline, whatever its status, is a
server that answers.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Mapping

from tf_distbelief import checks

# A TensorFlow server answers in milliseconds; a loaded 2-core machine
# starting several servers was seen at up to 1.2 s.
DEFAULT_PROBE_TIMEOUT_SECS = 3.0
# Registered by no server: answered by gRPC (UNIMPLEMENTED), not by a
# TensorFlow thread pool that the task's own work can hold (module docstring).
_PROBE_METHOD = "/tf_distbelief.Liveness/Probe"


class TaskState(enum.Enum):
    """What a probe found at a task's address."""

    ANSWERS = "answers"  # A gRPC server answered within the deadline.
    REFUSED = "refused"  # No gRPC connection (the task is down or not started).
    SILENT = "silent"  # It accepts connections but did not answer in time.

    def describe(self) -> str:
        """The state in words, for a line naming the task."""
        return {
            TaskState.ANSWERS: "answers",
            TaskState.REFUSED: "does not accept connections",
            TaskState.SILENT: (
                "accepts connections but does not answer (hung, or not a "
                "TensorFlow server)"
            ),
        }[self]


def probe(address: str, timeout_secs: float = DEFAULT_PROBE_TIMEOUT_SECS) -> TaskState:
    """Calls the task at `address`, waiting at most `timeout_secs` for an answer.

    Args:
      address: `"host:port"` of a ps or worker task.
      timeout_secs: the deadline of the call, in seconds, > 0.

    Returns:
      `TaskState.ANSWERS` if a gRPC server answered (a running TensorFlow
      server does, with `UNIMPLEMENTED`; any gRPC status other than a missed
      deadline or no connection counts, as the server then answered),
      `REFUSED` if no connection could be made, `SILENT` if the deadline
      passed with a connection but no answer.

    Raises:
      ValueError: `timeout_secs` is not > 0.
    """
    import grpc

    if not timeout_secs > 0:
        raise checks.argument_error("timeout_secs", "> 0", timeout_secs)
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(
            _PROBE_METHOD,
            request_serializer=lambda request: request,
            response_deserializer=lambda response: response,
        )
        call(b"", timeout=timeout_secs, wait_for_ready=False)
        return TaskState.ANSWERS
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TaskState.SILENT
        if code == grpc.StatusCode.UNAVAILABLE:
            return TaskState.REFUSED
        return TaskState.ANSWERS
    finally:
        channel.close()


def probe_all(
    tasks: Mapping[str, str], timeout_secs: float = DEFAULT_PROBE_TIMEOUT_SECS
) -> dict[str, TaskState]:
    """Probes every task at once; at most about `timeout_secs` in all.

    Args:
      tasks: `{task name: "host:port"}`.
      timeout_secs: each probe's deadline, in seconds, > 0.

    Returns:
      `{task name: TaskState}`, in the order of `tasks`.
    """
    if not tasks:
        return {}
    workers = min(32, len(tasks))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        states = pool.map(lambda a: probe(a, timeout_secs), tasks.values())
        return dict(zip(tasks, states))


def main(argv: list[str] | None = None) -> int:
    """`python -m tf_distbelief.cluster.health HOST:PORT [TIMEOUT_SECS]`.

    Returns:
      0 if the task answers, 1 if not (its state printed), 2 for bad arguments.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m tf_distbelief.cluster.health HOST:PORT [TIMEOUT_SECS]")
        return 2
    try:
        timeout_secs = float(args[1]) if len(args) == 2 else DEFAULT_PROBE_TIMEOUT_SECS
        state = probe(args[0], timeout_secs)
    except ValueError as e:
        print(e)
        return 2
    print(f"{args[0]} {state.describe()}")
    return 0 if state is TaskState.ANSWERS else 1


if __name__ == "__main__":
    raise SystemExit(main())
