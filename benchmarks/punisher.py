r"""The punisher: one long job under faults at a set mean time between failures.

`launch/train.py --model=digits` on its local cluster (2 workers, 2 ps,
`--model_dir`, checkpoints every `--checkpoint_every_steps`) runs to its end
while faults come at exponential intervals of mean `--mtbf_secs`: each picks
a target (a worker, a ps or the chief, each kind equally likely, then a task
of that kind) and a signal (SIGKILL, SIGSTOP or SIGTERM, equally likely).
SIGTERM is a preemption with a grace period, as an orchestrator sends it: a
chief saves the step reached and exits (`--preemption_grace_secs`), a ps or
worker tells the chief it is stopping and exits, and whatever still runs
`--grace_secs` after the signal is SIGKILLed. A SIGSTOPped task stays
stopped: the job's hung-task watch gives it up after
`--hung_task_timeout_secs` and kills it (ps and workers), and this script,
acting as the orchestrator, kills a chief that does not answer the liveness
probe the job's pods carry (`python -m tf_distbelief.cluster.health`, run each
second inside the local cluster's network namespace as a pod's exec probe runs
inside its pod) for `--chief_probe_secs`, or whose output has been silent for
`--chief_liveness_secs` (a stuck chief whose port still answers). A chief
that exits, or is killed, is started again with the same command and
`--model_dir`, as an orchestrator would; its cluster dies with it and
restarts with it.

A fault falls only while the job trains (a step line in the last 5 s) and,
for a ps, once a checkpoint exists (before it a lost ps is an error by
design: nothing to restore); a fault due earlier waits for that.

Reported: the faults by target and signal, whether every one was survived
(the job ends with exit 0 and no exit but the punisher's own kills), the
steps redone (from each restore back to the last step seen before its
fault), goodput (the job's own productive training seconds, summed over the
chief's lives, over this run's wall time from the first start to the end;
a chief killed before its goodput line counted from below, to the last
epoch line that the next life did not redo: `goodput_of`) and where the rest
went, by cause (`parts_of`), and the test accuracy against an unfaulted run
of the same command.

A pause between a life's last epoch line and its test accuracy longer than
`--stacks_after_secs` gets the chief SIGQUIT (once, then every 10 s of it):
the launched chief then writes every thread's Python stack into its output
(`job.runner.main`), in the life's log under `--work_dir`.

Usage:
  python benchmarks/punisher.py --mtbf_secs=120 --steps=60000   # about 20 min
  python benchmarks/punisher.py --mtbf_secs=20 --steps=6000 --noreference
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults_bench  # noqa: E402 - the benchmarks folder is not a package.

_POLL_SECS = 0.2
# A fault waits until the job has printed a step line within this long.
_TRAINING_SECS = 5.0
# The longest a whole job may take (a 20-minute job on a loaded machine).
_JOB_TIMEOUT_SECS = 4 * 3600.0
# How often the chief is started at most: a job that keeps failing by
# itself is not one the punisher can judge.
_MAX_LIVES = 200
_GOODPUT_RE = re.compile(
    r"^goodput: [0-9.]+% \(train ([0-9.]+) s of ([0-9.]+) s; .* redone ([0-9.]+) s"
)
# Each epoch's line ends with the job's goodput so far (`fit.lines`).
_EPOCH_GOODPUT_RE = re.compile(r"^epoch \d+/\d+: .*; goodput ([0-9.]+)%$")
_RESTORED_RE = re.compile(r"^(?:restored|Resumed from) .*?ckpt-(\d+)")
# The goodput line's parts (`faults.goodput.Goodput.line`).
_PARTS_RE = re.compile(
    r"^goodput: [0-9.]+% \(train (?P<train>[0-9.]+) s of (?P<wall>[0-9.]+) s; "
    r"checkpointing (?P<checkpointing>[0-9.]+) s, recovery (?P<recovery>[0-9.]+) "
    r"s, start-up (?P<start_up>[0-9.]+) s, redone (?P<redone>[0-9.]+) s, other "
    r"(?P<other>[0-9.]+) s\)"
)
_LAST_EPOCH_RE = re.compile(r"^epoch (\d+)/\1: ")
_ACCURACY_RE = re.compile(r"^test accuracy: ")
# A Python stack dump's lines (`faulthandler`), not the job's own output.
_STACK_RE = re.compile(r'^(?:Thread 0x|Current thread 0x|  File "|\s*$)')
# Where the wall time went, in the table's order (`parts_of`).
CAUSES = (
    "start-up",
    "recovery",
    "redone",
    "checkpointing",
    "end-of-fit",
    "chief lost",
    "other",
)
_STACKS_EVERY_SECS = 10.0
_STEP_RE = re.compile(r"^(?:step|epoch \d+/\d+: steps) (\d+)/\d+")


def define_flags():
    flags.DEFINE_float(
        "mtbf_secs", 120.0, "Mean seconds between faults.", lower_bound=1
    )
    flags.DEFINE_integer("steps", 60000, "Steps of the job.", lower_bound=100)
    flags.DEFINE_integer("steps_per_epoch", 500, "Steps per epoch.", lower_bound=10)
    flags.DEFINE_integer("checkpoint_every_steps", 500, "Checkpoint cadence.")
    flags.DEFINE_float("hung_task_timeout_secs", 10.0, "The job's hung-task bound.")
    flags.DEFINE_float(
        "chief_liveness_secs", 30.0, "A training chief silent this long is killed."
    )
    flags.DEFINE_float(
        "chief_probe_secs",
        6.0,
        "A training chief whose port has not answered the liveness probe "
        "(`tf_distbelief.cluster.health`, each second, 3 s deadline) for this "
        "long is killed; 0: no probe.",
        lower_bound=0,
    )
    flags.DEFINE_multi_enum(
        "signals",
        ["SIGKILL", "SIGSTOP", "SIGTERM"],
        ["SIGKILL", "SIGSTOP", "SIGTERM"],
        "Faults to draw (SIGTERM: a preemption, SIGKILL after --grace_secs).",
    )
    flags.DEFINE_float(
        "grace_secs",
        30.0,
        "After a SIGTERM, what still runs this long is SIGKILLed (Kubernetes' "
        "terminationGracePeriodSeconds); the chief saves within "
        "--preemption_grace_secs.",
        lower_bound=0,
    )
    flags.DEFINE_float(
        "preemption_grace_secs", 25.0, "The job's --preemption_grace_secs."
    )
    flags.DEFINE_float(
        "stacks_after_secs",
        5.0,
        "SIGQUIT the chief (its threads' stacks into its log) once it has "
        "paused this long between its last epoch and its test accuracy; 0: never.",
        lower_bound=0,
    )
    flags.DEFINE_integer("seed", 0, "Seed of the faults (times, targets, signals).")
    flags.DEFINE_bool("reference", True, "Also run the job unfaulted, first.")
    flags.DEFINE_string("out", None, "Also write the results as JSON here.")
    flags.DEFINE_string(
        "work_dir", None, "Keep the jobs' folders and logs here (default: temporary)."
    )


def job_args(model_dir: str) -> list[str]:
    f = flags.FLAGS
    return [
        "--model=digits",
        "--num_workers=2",
        "--num_ps=2",
        f"--epochs={max(1, f.steps // f.steps_per_epoch)}",
        f"--steps_per_epoch={f.steps_per_epoch}",
        f"--checkpoint_every_steps={f.checkpoint_every_steps}",
        f"--hung_task_timeout_secs={f.hung_task_timeout_secs}",
        f"--preemption_grace_secs={f.preemption_grace_secs}",
        f"--log_every_steps={max(10, f.steps_per_epoch // 10)}",
        f"--model_dir={model_dir}",
    ]


# The liveness probe's loop, run inside the local cluster's network namespace:
# one line per probe (`health.TaskState` values), each second.
_PROBE_LOOP = """
import sys, time
from tf_distbelief.cluster import health
while True:
    print(health.probe(sys.argv[1], 3.0).value, flush=True)
    time.sleep(1.0)
"""


class ChiefProbe:
    """The orchestrator's liveness probe of one chief: `cluster.health`'s gRPC
    probe of the chief's port each second, run inside the local cluster's
    network namespace (as a pod's exec probe runs inside its pod), once the
    chief has trained (its port then serves)."""

    def __init__(self, marker: str):
        self._marker = marker
        self._proc: subprocess.Popen | None = None
        self.last_answer: float | None = None
        self.silent_since: float | None = None

    def start(self) -> bool:
        """Starts the probe; False while no task shows the cluster yet."""
        if self._proc is not None:
            return True
        try:
            pid = faults_bench._task_pid(self._marker, "worker", 0)
        except RuntimeError:
            return False
        config = json.loads(faults_bench._environ(pid).get("TF_CONFIG") or "{}")
        chief = config.get("cluster", {}).get("chief")
        if not chief:
            return False
        enter = ["nsenter", "-t", str(pid), "-n"]
        if os.geteuid() != 0:
            enter[3:3] = ["-U", "--preserve-credentials"]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("FAULTS_BENCH_MARKER", None)
        self._proc = subprocess.Popen(
            [*enter, sys.executable, "-u", "-c", _PROBE_LOOP, chief[0]],
            cwd=faults_bench.ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        atexit.register(self.stop)
        self.last_answer = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()
        return True

    def _read(self):
        for line in self._proc.stdout:
            now = time.monotonic()
            if line.strip() == "answers":
                if self.silent_since is not None:
                    print(
                        f"chief probe: answers again after "
                        f"{now - self.silent_since:.1f} s",
                        flush=True,
                    )
                self.last_answer, self.silent_since = now, None
            elif self.silent_since is None:
                self.silent_since = now
                print(f"chief probe: {line.strip()}", flush=True)

    def unanswered_secs(self, now: float) -> float:
        """Seconds since the chief last answered (0 before the probe runs)."""
        return 0.0 if self.last_answer is None else now - self.last_answer

    def stop(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class Life:
    """One start of the chief: its process and what its lines say."""

    def __init__(self, args, folder, number):
        self.marker = uuid.uuid4().hex
        name = number if isinstance(number, str) else f"life{number}"
        self.job = faults_bench._Job(args, folder, name, self.marker)
        self.started = time.monotonic()
        self.ended: float | None = None  # When its exit was seen.
        self.stacks_at: float | None = None  # When SIGQUIT was last sent.
        self.killed_by_us = False
        self.liveness_killed = False
        self.probe = ChiefProbe(self.marker)

    def last_step_line_at(self) -> float | None:
        seen = [at for at, line in self.job.poll_lines() if _STEP_RE.match(line)]
        return seen[-1] if seen else None

    def last_step(self) -> int:
        steps = [int(m[1]) for _, line in self.job.lines if (m := _STEP_RE.match(line))]
        return max(steps, default=0)

    def stacks_if_paused(self, now: float) -> None:
        """SIGQUITs the chief (every thread's stack into its log,
        `job.runner.main`) while it pauses after its last epoch, once
        `--stacks_after_secs` have passed and then every 10 s."""
        pause = self.end_of_fit_pause(now)
        after = flags.FLAGS.stacks_after_secs
        if not (after > 0 and pause > after):
            return
        if self.stacks_at is not None and now - self.stacks_at < _STACKS_EVERY_SECS:
            return
        self.stacks_at = now
        os.kill(self.job.proc.pid, signal.SIGQUIT)
        print(
            f"chief paused {pause:.0f} s after its last epoch: SIGQUIT (stacks "
            f"in {self.job.path})",
            flush=True,
        )

    def end_of_fit_pause(self, now: float) -> float:
        """Seconds since its last epoch line with no test accuracy yet (0:
        not in that pause)."""
        last = [at for at, line in self.job.lines if _LAST_EPOCH_RE.match(line)]
        if not last or any(
            at >= last[-1] for at, line in self.job.lines if _ACCURACY_RE.match(line)
        ):
            return 0.0
        return now - last[-1]


def goodput_of(
    job, started: float, resumed_step: int | None = None
) -> tuple[float, float]:
    """(train s, redone s) of a job's goodput line, which ends a job.

    A chief killed before it (no such line) counts the training seconds of
    its last epoch line that the next life did not redo: the last at a step
    at most `resumed_step` (where the next life resumed; None: not known,
    the last epoch line), no redone seconds; what it trained after that line
    is lost. The line gives the job's goodput percent (`fit.lines`, to 0.1)
    of its wall time then; counted from below, never in the job's favour:
    the percent less 0.05, of the time from `started` (when this script
    started it, on `time.monotonic`'s scale) to the read before the one that
    found the line (`faults_bench._Job.written_after`).
    """
    lines = job.poll_lines()
    found = [m for _, line in lines if (m := _GOODPUT_RE.match(line))]
    if found:
        return float(found[-1][1]), float(found[-1][3])
    epochs = [
        (job.written_after[i], float(m[1]), int(_STEP_RE.match(line)[1]))
        for i, (_, line) in enumerate(lines)
        if (m := _EPOCH_GOODPUT_RE.match(line))
    ]
    kept = [e for e in epochs if resumed_step is None or e[2] <= resumed_step]
    if not kept:
        return 0.0, 0.0
    after, percent, _ = kept[-1]
    return max(0.0, percent - 0.05) / 100 * max(0.0, after - started), 0.0


def parts_of(
    job, started: float, ended: float, resumed_step: int | None = None
) -> dict[str, float]:
    """One life's wall time (`started` to `ended`, on `time.monotonic`'s
    scale, as this script saw them) by cause, `train` and `CAUSES`.

    A life that printed its goodput line: its parts; `end-of-fit`, from its
    last epoch line to its test accuracy line, is taken out of its `other`
    (that time is `other` in the job's accounting, at most all of it); the
    time outside the job's own wall (its exit after the line) is `other`. A
    life killed before that line: the training seconds of its last epoch
    line that the next life did not redo (`goodput_of`, `resumed_step`); if
    its last epoch line was the job's last epoch, the time from it to the
    kill is `end-of-fit`; the rest is `chief lost` (a life that only found
    the job trained, after such a kill, is all `chief lost`).
    """
    lines = job.poll_lines()
    parts = dict.fromkeys(("train", *CAUSES), 0.0)
    found = [m for _, line in lines if (m := _PARTS_RE.match(line))]
    life_secs = max(0.0, ended - started)
    last = [at for at, line in lines if _LAST_EPOCH_RE.match(line)]
    if not found:
        parts["train"] = min(life_secs, goodput_of(job, started, resumed_step)[0])
        if last:
            parts["end-of-fit"] = min(life_secs - parts["train"], ended - last[-1])
        parts["chief lost"] = life_secs - parts["train"] - parts["end-of-fit"]
        return parts
    figures = {k.replace("_", "-"): float(v) for k, v in found[-1].groupdict().items()}
    for part in ("train", "checkpointing", "recovery", "start-up", "redone", "other"):
        parts[part] = figures[part]
    accuracy = [at for at, line in lines if _ACCURACY_RE.match(line)]
    if last and accuracy and accuracy[-1] >= last[-1]:
        pause = min(parts["other"], accuracy[-1] - last[-1])
        parts["end-of-fit"], parts["other"] = pause, parts["other"] - pause
    parts["other"] += max(0.0, life_secs - figures["wall"])
    return parts


def resumed_steps(lives: list[Life]) -> list[int | None]:
    """For each life, the step the lives after it resumed from: the first
    restore line of the first later life that restored or trained (0: it
    trained from the start, no checkpoint), None where no later life did.

    A killed chief's steps after that one were lost: the next life did them
    again (and counts them as its own training).
    """
    resumed: list[int | None] = []
    for number in range(len(lives)):
        step = None
        for later in lives[number + 1 :]:
            for _, line in later.job.lines:
                if restored := _RESTORED_RE.match(line):
                    step = int(restored[1])
                elif _STEP_RE.match(line):
                    step = 0
                else:
                    continue
                break
            if step is not None:
                break
        resumed.append(step)
    return resumed


def steps_redone(lives: list[Life]) -> int:
    """Steps done twice: at each restore (a ps recovered, a chief started
    again), from the highest step seen before it back to the checkpoint."""
    redone, highest = 0, 0
    for life in lives:
        for _, line in life.job.lines:
            if step := _STEP_RE.match(line):
                highest = max(highest, int(step[1]))
            elif restored := _RESTORED_RE.match(line):
                redone += max(0, highest - int(restored[1]))
                highest = int(restored[1])
    return redone


def _start_ticks(pid: int) -> int | None:
    """A process's start time (`/proc/PID/stat` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _still(pid: int, ticks: int | None) -> bool:
    """Whether process `pid` still runs and is the one that started at `ticks`."""
    now = _start_ticks(pid)
    return now is not None and now == ticks


def _checkpointed(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, "checkpoints", "checkpoint"))


def punish(folder: str) -> dict:
    """The faulted run; returns its summary."""
    f = flags.FLAGS
    rng = random.Random(f.seed)
    model_dir = os.path.join(folder, "model")
    args = job_args(model_dir)
    start = time.monotonic()
    lives = [Life(args, folder, 0)]
    faults, unexpected_exits = [], []
    next_fault = start + rng.expovariate(1.0 / f.mtbf_secs)
    # `(deadline, pid, start ticks)` of each process SIGTERMed: SIGKILLed at
    # its deadline if it still runs, as an orchestrator's grace period ends.
    graces: list[tuple[float, int, int | None]] = []
    while True:
        life = lives[-1]
        code = life.job.proc.poll()
        now = time.monotonic()
        for grace in [g for g in graces if g[0] <= now]:
            graces.remove(grace)
            if _still(grace[1], grace[2]):
                os.kill(grace[1], signal.SIGKILL)
                print(f"grace over: pid {grace[1]} SIGKILLed", flush=True)
        if code is not None:
            life.ended = now
            life.probe.stop()
            life.job.finish()
            if code == 0:
                break
            if not life.killed_by_us:
                unexpected_exits.append({"life": len(lives) - 1, "exit": code})
            if len(lives) >= _MAX_LIVES:
                break
            lives.append(Life(args, folder, len(lives)))
            continue
        last_line = life.last_step_line_at()
        said = [at for at, line in life.job.lines if not _STACK_RE.match(line)]
        silent = now - max(said[-1] if said else 0, life.started)
        life.stacks_if_paused(now)
        if last_line is not None and f.chief_probe_secs > 0:
            life.probe.start()
        unanswered = life.probe.unanswered_secs(now)
        if last_line is not None and (
            silent > f.chief_liveness_secs
            or (f.chief_probe_secs > 0 and unanswered > f.chief_probe_secs)
        ):
            # The orchestrator's liveness probes: a chief that trained and
            # stopped answering on its port, or went silent, is hung. Killed
            # once; a kill can take a while to end it.
            if not life.liveness_killed:
                life.killed_by_us = life.liveness_killed = True
                os.kill(life.job.proc.pid, signal.SIGKILL)
                why = (
                    f"did not answer its liveness probe for {unanswered:.0f} s"
                    if silent <= f.chief_liveness_secs
                    else f"silent for {silent:.0f} s"
                )
                print(f"chief {why}: killed (liveness)", flush=True)
            time.sleep(_POLL_SECS)
            continue
        training = last_line is not None and now - last_line < _TRAINING_SECS
        if now >= next_fault and training:
            kind = rng.choice(("worker", "ps", "chief"))
            sig = getattr(signal, rng.choice(f.signals))
            if kind == "ps" and not _checkpointed(model_dir):
                time.sleep(_POLL_SECS)
                continue
            index = 0 if kind == "chief" else rng.randrange(2)
            try:
                pid = (
                    life.job.proc.pid
                    if kind == "chief"
                    else faults_bench._task_pid(life.marker, kind, index)
                )
            except RuntimeError:  # Being restarted: draw again later.
                time.sleep(_POLL_SECS)
                continue
            # A stopped chief is killed by the liveness probe, also ours.
            life.killed_by_us = life.killed_by_us or kind == "chief"
            os.kill(pid, sig)
            if sig == signal.SIGTERM:
                graces.append((now + f.grace_secs, pid, _start_ticks(pid)))
            faults.append(
                {
                    "at s": round(now - start, 1),
                    "target": f"{kind}:{index}",
                    "signal": sig.name,
                    "life": len(lives) - 1,
                    "last step": life.last_step(),
                }
            )
            print(json.dumps(faults[-1]), flush=True)
            next_fault = now + rng.expovariate(1.0 / f.mtbf_secs)
        time.sleep(_POLL_SECS)
    wall = time.monotonic() - start
    resumed = resumed_steps(lives)
    figures = [goodput_of(life.job, life.started, r) for life, r in zip(lives, resumed)]
    train = sum(f[0] for f in figures)
    redone_secs = sum(f[1] for f in figures)
    causes = dict.fromkeys(("train", *CAUSES), 0.0)
    for life, step in zip(lives, resumed):
        ended = life.ended or start
        for part, secs in parts_of(life.job, life.started, ended, step).items():
            causes[part] += secs
    # Between lives: a chief's exit seen, the next one started.
    causes["other"] += max(0.0, wall - sum(causes.values()))
    final = lives[-1]
    accuracy = faults_bench._accuracy(final.job)
    return {
        "wall s": round(wall, 1),
        "train s": round(train, 1),
        "redone s": round(redone_secs, 1),
        "goodput %": round(100 * train / wall, 1),
        "by cause s": {k: round(v, 1) for k, v in causes.items()},
        "faults": faults,
        "chief lives": len(lives),
        "unexpected exits": unexpected_exits,
        "survived": final.job.proc.returncode == 0 and not unexpected_exits,
        "steps redone": steps_redone(lives),
        "test accuracy": accuracy,
    }


def by_cause_table(causes: dict[str, float], wall: float) -> str:
    """The wall time by cause, in seconds and percent, as a Markdown table."""
    names = ("train", *CAUSES)
    head = "| " + " | ".join(names) + " | wall |"
    rule = "|---" * (len(names) + 1) + "|"
    cells = [f"{causes[n]:.1f} s ({100 * causes[n] / wall:.1f}%)" for n in names]
    return "\n".join([head, rule, "| " + " | ".join(cells) + f" | {wall:.1f} s |"])


def main(argv):
    del argv
    f = flags.FLAGS
    with tempfile.TemporaryDirectory(prefix="punisher_") as temporary:
        root = f.work_dir or temporary
        reference = None
        if f.reference:
            folder = os.path.join(root, "unfaulted")
            os.makedirs(folder)
            begin = time.monotonic()
            unfaulted = Life(job_args(os.path.join(folder, "model")), folder, "run")
            base = unfaulted.job
            while base.proc.poll() is None:
                base.poll_lines()
                unfaulted.stacks_if_paused(time.monotonic())
                time.sleep(_POLL_SECS)
            code, _ = base.finish(_JOB_TIMEOUT_SECS)
            reference = faults_bench._accuracy(base)
            train = goodput_of(base, begin)[0]
            print(
                f"unfaulted: exit {code}, test accuracy {reference}, "
                f"{time.monotonic() - begin:.0f} s, goodput "
                f"{100 * train / (time.monotonic() - begin):.1f}%",
                flush=True,
            )
        folder = os.path.join(root, "faulted")
        os.makedirs(folder)
        result = punish(folder)
    result["unfaulted accuracy"] = reference
    kinds: dict[str, int] = {}
    for fault in result["faults"]:
        key = f"{fault['target'].split(':')[0]} {fault['signal']}"
        kinds[key] = kinds.get(key, 0) + 1
    print()
    columns = "faults | survived | goodput | train s | wall s | steps redone | "
    columns += "chief lives | acc | unfaulted acc"
    print(f"| {columns} |")
    print("|---" * (columns.count("|") + 1) + "|")
    drawn = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
    cells = [
        f"{len(result['faults'])} ({drawn})",
        "yes" if result["survived"] else "no",
        f"{result['goodput %']}%",
        result["train s"],
        result["wall s"],
        result["steps redone"],
        result["chief lives"],
        result["test accuracy"],
        reference,
    ]
    print("| " + " | ".join(map(str, cells)) + " |")
    print()
    print(by_cause_table(result["by cause s"], result["wall s"]))
    if result["unexpected exits"]:
        print(f"unexpected exits: {result['unexpected exits']}")
    if f.out:
        with open(f.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
