"""Where a job keeps its files: the one owner of the model_dir and export_dir layout.

A job's `model_dir` holds:

* `checkpoints/ckpt-<step>`: the checkpoints `fit.training.fit` writes,
  numbered by global step (the model, its optimizer, the step, and an
  algorithm's own state such as Downpour's replicas);
* `sandblaster/ckpt-<iteration>`: Sandblaster L-BFGS's checkpoints, numbered
  by L-BFGS iteration;
* `tensorboard/` (and `tensorboard/eval/`, the evaluator's): TensorBoard
  scalars;
* `cluster/`: a local cluster's task logs (`<job>_<index>.log`), kept for
  reading after a failure (without a `model_dir` they go to a temporary
  folder removed when the job ends);
* `.lock`: while a job trains into it, who (host, pid, since when);
  `ModelDirLock` takes it, so that one job at a time writes a `model_dir`.

An `export_dir` holds `saved_model/` (a SavedModel) and `model.keras`.

Every module that writes, finds or names these files asks this one; nothing
else spells a folder name or parses a checkpoint number. No TensorFlow at
import: finding the latest checkpoint imports it when called.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import socket
import threading

from tf_distbelief import checks, errors

__all__ = [
    "CHECKPOINT_PREFIX",
    "KERAS_FILE",
    "LOCK_FILE",
    "MAX_CHECKPOINTS_TO_KEEP",
    "ModelDirInUseError",
    "ModelDirLock",
    "SAVED_MODEL_SUBDIR",
    "check_model_dir",
    "check_parent_writable",
    "probe_writable",
    "checkpoint_dir",
    "cluster_log_dir",
    "checkpoint_number",
    "describe_checkpoint",
    "eval_tensorboard_dir",
    "latest_checkpoint",
    "sandblaster_dir",
    "tensorboard_dir",
]

# Folders of a model_dir, each written by one kind of writer.
_CHECKPOINTS = "checkpoints"
_SANDBLASTER = "sandblaster"
_TENSORBOARD = "tensorboard"
_CLUSTER = "cluster"
_EVAL = "eval"
# `tf.train.CheckpointManager`'s default prefix: `ckpt-<number>`.
CHECKPOINT_PREFIX = "ckpt"
# Checkpoints a `CheckpointManager` keeps; it only ever deletes its own
# `ckpt-N` files, never anything else in `model_dir`.
MAX_CHECKPOINTS_TO_KEEP = 3
# An export_dir's contents.
SAVED_MODEL_SUBDIR = "saved_model"
KERAS_FILE = "model.keras"

# Who trains into a model_dir: JSON `{"host", "pid", "since"}`.
LOCK_FILE = ".lock"

_NUMBER_RE = re.compile(r"-(\d+)$")


def check_model_dir(model_dir: str) -> None:
    """Checks, before any cluster starts, that `model_dir` can be a job's folder.

    Allowed: an existing directory, or a new path whose nearest existing
    parent is a writable directory.

    Raises:
      ConfigError: naming `model_dir`, the value and what is in the way.
    """
    path = os.path.abspath(model_dir)
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise checks.argument_error(
            "model_dir",
            "a directory (new or existing)",
            model_dir,
            "(a file)",
            setting=True,
        )
    check_parent_writable("model_dir", model_dir, "made")


def check_parent_writable(name: str, path: str, verb: str) -> None:
    """Raises unless the nearest existing folder of `path` is writable.

    A look at the permission bits, cheap enough for every task of a job; the
    chief also writes there before any server starts (`probe_writable`).

    Args:
      name: the setting, for the message (`model_dir`, `export_dir`).
      path: the path given.
      verb: what the message says cannot be done ("made", "written").

    Raises:
      ConfigError: naming the setting, the path and the folder in the way.
    """
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
        raise errors.ConfigError(
            f"`{name}` {path!r} cannot be {verb}: {parent!r} is not a "
            "writable directory."
        )


def probe_writable(name: str, path: str) -> None:
    """Makes folder `path` and writes, syncs and removes a small file in it.

    Permission bits do not say whether a folder takes files: root passes
    them on `/proc` and on a read-only mount, and a full disk or a quota
    passes them too. Doing it does; the chief does it before any server
    starts, so that a job that could not save is refused, not run. A URL
    (`gs://...`) is left to TensorFlow's file systems.

    Args:
      name: the setting, for the message (`model_dir`, `export_dir`).
      path: the folder.

    Raises:
      ConfigError: one line naming the setting, the path and the system's
        reason.
    """
    if "://" in path:
        return
    probe = os.path.join(path, f".tf_distbelief_probe_{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise errors.ConfigError(
            f"`{name}` {path!r} cannot be written: {e.strerror or e}."
        ) from None


def checkpoint_dir(model_dir: str) -> str:
    """`model_dir/checkpoints`: `fit.training.fit`'s checkpoints, `ckpt-<step>`."""
    return os.path.join(model_dir, _CHECKPOINTS)


def sandblaster_dir(model_dir: str) -> str:
    """`model_dir/sandblaster`: Sandblaster's checkpoints, `ckpt-<iteration>`."""
    return os.path.join(model_dir, _SANDBLASTER)


def cluster_log_dir(model_dir: str) -> str:
    """`model_dir/cluster`: a local cluster's task logs and ready files."""
    return os.path.join(model_dir, _CLUSTER)


def tensorboard_dir(model_dir: str) -> str:
    """`model_dir/tensorboard`: the training job's TensorBoard scalars."""
    return os.path.join(model_dir, _TENSORBOARD)


def eval_tensorboard_dir(model_dir: str) -> str:
    """`model_dir/tensorboard/eval`: the evaluator's TensorBoard scalars."""
    return os.path.join(model_dir, _TENSORBOARD, _EVAL)


def checkpoint_number(path: str) -> int | None:
    """The number of checkpoint `path` (`.../ckpt-40` -> 40), or None.

    Args:
      path: a checkpoint prefix, as `tf.train.CheckpointManager` names them.

    Returns:
      The step (`checkpoints/`) or L-BFGS iteration (`sandblaster/`) in its
      name, or None for a path not named `<prefix>-<number>`.
    """
    match = _NUMBER_RE.search(path)
    return int(match.group(1)) if match else None


def describe_checkpoint(path: str) -> str:
    """`ckpt-40 (step 40)` for `.../checkpoints/ckpt-40`, for progress lines.

    Sandblaster's checkpoints (`model_dir/sandblaster/ckpt-3`) are numbered by
    L-BFGS iteration: `ckpt-3 (iteration 3)`.
    """
    name = os.path.basename(path)
    number = checkpoint_number(name)
    if number is None:
        return name
    folder = os.path.basename(os.path.dirname(path))
    unit = "iteration" if folder == _SANDBLASTER else "step"
    return f"{name} ({unit} {number})"


def latest_checkpoint(model_dir: str | None) -> str | None:
    """The newest checkpoint of a job's `model_dir`, or None.

    Looks in `checkpoint_dir(model_dir)` first; then, for a path that is
    itself a checkpoint folder or holds other `tf.train.CheckpointManager`
    folders (Sandblaster's), the newest checkpoint among `model_dir` and its
    direct subfolders.

    Args:
      model_dir: the job's `model_dir`, a checkpoint folder, or None.

    Returns:
      A checkpoint prefix (`.../ckpt-40`), or None when there is none.
    """
    import tensorflow as tf  # Only here: the layout itself needs none.

    if not model_dir:
        return None
    found = tf.train.latest_checkpoint(checkpoint_dir(model_dir))
    if found:
        return found
    folders = [model_dir]
    if os.path.isdir(model_dir):
        folders += [
            os.path.join(model_dir, name)
            for name in sorted(os.listdir(model_dir))
            if os.path.isfile(os.path.join(model_dir, name, "checkpoint"))
        ]
    found = [p for p in map(tf.train.latest_checkpoint, folders) if p]
    return max(found, key=lambda p: os.path.getmtime(p + ".index"), default=None)


class ModelDirInUseError(errors.ConfigError):
    """A job's `model_dir` is in use by another live job (`ModelDirLock`).

    Attributes:
      model_dir: the folder.
      holder: the lock file's record of the other job, `{"host", "pid",
        "since"}` (empty when it could not be read).
    """

    def __init__(self, message: str, model_dir: str, holder: dict):
        super().__init__(message)
        self.model_dir = model_dir
        self.holder = dict(holder)


def _describe_holder(holder: dict) -> str:
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
        f"since {holder.get('since', '?')}"
    )


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # Someone else's process: alive.
    return True


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


# Locks this process holds: `{real path of the lock file: [fd, depth]}`.
_HELD: dict[str, list] = {}
_HELD_LOCK = threading.Lock()


class ModelDirLock:
    """One job per `model_dir`: a context manager holding `model_dir/.lock`.

    Entering creates the folder and the lock file (`O_EXCL`), writes who
    holds it (host, pid, start time) and keeps an exclusive `fcntl.flock` on
    it until exit, which removes the file. The kernel releases a flock when
    its process ends, however it ends: a lock file left by a job that was
    killed has a free flock, and the next job takes it over (and says so,
    one line to `print_fn`). Where the file system has no flock, a holder on
    this host whose pid is gone is taken over.

    Re-entrant within a process: the job runner takes it for the whole job
    and `fit.training.fit` takes it again for its run; only the outermost
    exit releases it.

    Args:
      model_dir: the job's `model_dir`.
      print_fn: where the line about a lock taken over goes (None: nowhere).

    Raises:
      ModelDirInUseError: on entering, when another live process holds it,
        naming the folder and the holder.
    """

    def __init__(self, model_dir: str, print_fn=None):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self._print_fn = print_fn
        self._key: str | None = None

    def __enter__(self) -> ModelDirLock:
        check_model_dir(self.model_dir)
        os.makedirs(self.model_dir, exist_ok=True)
        key = os.path.realpath(self.path)
        with _HELD_LOCK:
            if key in _HELD:
                _HELD[key][1] += 1
            else:
                _HELD[key] = [self._acquire(), 1]
        self._key = key
        return self

    def __exit__(self, *exc) -> None:
        key, self._key = self._key, None
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                os.close(held[0])  # Releases the flock.

    def _acquire(self) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # Released meanwhile: create it.
                created = False
            try:
                stale = self._lock_or_raise(fd, created)
                # Removed (released) and made anew between our open and our
                # flock: ours is a file nobody will look at again.
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if stale and self._print_fn is not None:
                self._print_fn(
                    f"model_dir: took over {self.path} from a job that is gone "
                    f"({_describe_holder(stale)})"
                )
            me = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": datetime.datetime.now().astimezone().isoformat("T", "seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
            return fd

    def _lock_or_raise(self, fd: int, created: bool) -> dict | None:
        """Takes the flock of `fd`; the stale holder's record (None: none)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = True
        except BlockingIOError:
            raise self._in_use(_read_holder(fd)) from None
        except OSError:  # No flock on this file system: trust the pid.
            flock = False
        if created:
            return None
        holder = _read_holder(fd)
        if not flock and holder.get("host") == socket.gethostname():
            if _pid_alive(holder.get("pid")) and holder.get("pid") != os.getpid():
                raise self._in_use(holder)
        return holder

    def _in_use(self, holder: dict) -> ModelDirInUseError:
        return ModelDirInUseError(
            f"--model_dir={self.model_dir} is in use by another job "
            f"({_describe_holder(holder)}; lock file {self.path}). One job at "
            "a time trains into a model_dir: wait for that job to end or stop "
            "it, or give this one another --model_dir.",
            self.model_dir,
            holder,
        )


def release_held_locks() -> None:
    """Releases every `ModelDirLock` this process holds (its file removed).

    For a process that ends at once (`console.end_process`, after a signal
    stopped the job) without unwinding the `with` blocks that hold them: the
    kernel would release the flocks, but the files would stay, and the next
    run would say it took over from a job that is gone.
    """
    with _HELD_LOCK:
        for key, (fd, _) in list(_HELD.items()):
            del _HELD[key]
            with contextlib.suppress(OSError):
                os.unlink(key)
            with contextlib.suppress(OSError):
                os.close(fd)


def model_dir_lock(
    model_dir: str | None, print_fn=None
) -> ModelDirLock | contextlib.nullcontext:
    """What a training run holds while it trains into `model_dir`.

    The one way every trainer (`fit.fit`, `keras3.fit`, Sandblaster) takes
    the lock: one job per `model_dir`, no other process writes checkpoints
    between ours.

    Args:
      model_dir: the job's `model_dir`, or None (nothing to hold).
      print_fn: where the line about a lock taken over goes (None: nowhere).

    Returns:
      A context manager: `ModelDirLock(model_dir, print_fn)`, or a
      `contextlib.nullcontext()` without a `model_dir`.
    """
    if not model_dir:
        return contextlib.nullcontext()
    return ModelDirLock(model_dir, print_fn)
