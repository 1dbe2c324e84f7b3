"""The model_dir layout's lock: one job per model_dir, a dead holder taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest

import tf_distbelief as tfdb
from tests.fixtures.launch import ROOT, _env
from tf_distbelief import paths

_HOLD = textwrap.dedent("""
    import sys, time
    from tf_distbelief import paths
    with paths.ModelDirLock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def _holder(model_dir):
    """A child process holding `model_dir`'s lock (no TensorFlow)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(model_dir)],
        cwd=ROOT,
        env=_env(uuid.uuid4().hex),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_a_killed_one_is_taken_over(tmp_path):
    model_dir = str(tmp_path / "model")
    holder = _holder(model_dir)
    try:
        with pytest.raises(paths.ModelDirInUseError) as refused:
            with paths.ModelDirLock(model_dir):
                pass
        message = str(refused.value)
        assert f"--model_dir={model_dir} is in use by another job" in message
        assert f"host {socket.gethostname()}, pid {holder.pid}, since " in message
        assert refused.value.holder["pid"] == holder.pid
        assert isinstance(refused.value, tfdb.ConfigError)
        assert tfdb.ModelDirInUseError is paths.ModelDirInUseError
        # A killed holder's flock is free; its lock file stays behind.
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert os.path.exists(os.path.join(model_dir, paths.LOCK_FILE))
        lines = []
        with paths.ModelDirLock(model_dir, lines.append) as lock:
            with open(lock.path) as f:
                record = json.load(f)
            assert record["pid"] == os.getpid()
            assert record["host"] == socket.gethostname()
        assert len(lines) == 1
        assert lines[0].startswith(f"model_dir: took over {lock.path} from a job ")
        assert f"pid {holder.pid}," in lines[0]
        assert not os.path.exists(lock.path)  # Released: removed.
    finally:
        holder.kill()
        holder.wait(30)


def test_reentrant_in_one_process_and_released_on_error(tmp_path):
    model_dir = str(tmp_path)
    lock_file = os.path.join(model_dir, paths.LOCK_FILE)
    with pytest.raises(RuntimeError, match="boom"):
        with paths.ModelDirLock(model_dir):
            with paths.ModelDirLock(os.path.join(model_dir, ".")):
                pass
            assert os.path.exists(lock_file)  # The outer one holds it still.
            raise RuntimeError("boom")
    assert not os.path.exists(lock_file)
    # Free for another process now.
    holder = _holder(model_dir)
    holder.kill()
    holder.wait(30)


def test_a_model_dir_that_is_a_file_is_refused_by_name(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(tfdb.ConfigError, match=r"`model_dir` must be a directory"):
        paths.check_model_dir(str(afile))
    with pytest.raises(tfdb.ConfigError, match=r"cannot be made: .*afile"):
        paths.check_model_dir(str(afile / "sub"))
    paths.check_model_dir(str(tmp_path / "new" / "run"))  # Made when used.
    paths.check_model_dir(str(tmp_path))
    assert afile.read_text() == "mine"


def test_probe_writable_makes_the_folder_and_leaves_nothing_else(tmp_path):
    paths.probe_writable("model_dir", str(tmp_path / "new" / "run"))
    assert os.listdir(tmp_path / "new" / "run") == []
    with pytest.raises(
        tfdb.ConfigError,
        match=r"^`export_dir` '/proc/tfdb_test' cannot be written: No such file",
    ):
        paths.probe_writable("export_dir", "/proc/tfdb_test")


def test_probe_writable_refuses_a_read_only_mount(tmp_path):
    # A read-only bind mount in a mount namespace of a child's own: as root,
    # the permission bits say writable; only the write says otherwise.
    code = (
        "from tf_distbelief import paths, errors\n"
        "try:\n"
        f"    paths.probe_writable('model_dir', {str(tmp_path / 'run')!r})\n"
        "except errors.ConfigError as e:\n"
        "    print(e)\n"
    )
    mount = (
        f"mount --bind {tmp_path} {tmp_path} && "
        f"mount -o remount,bind,ro {tmp_path} && "
        f'exec {sys.executable} -c "$0"'
    )
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if proc.returncode and "unshare" in proc.stderr:
        pytest.skip(f"no user and mount namespaces here: {proc.stderr.strip()}")
    assert proc.stdout.strip() == (
        f"`model_dir` {str(tmp_path / 'run')!r} cannot be written: "
        "Read-only file system."
    ), proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_process_that_ends_at_once_releases_its_locks_first(tmp_path):
    # `console.end_process` (a job stopped by a signal) skips the `with`
    # blocks: it releases the locks itself, so the next job takes the folder
    # without a takeover line.
    code = textwrap.dedent(
        f"""
        from tf_distbelief import console, paths
        lock = paths.model_dir_lock({str(tmp_path / "run")!r})
        lock.__enter__()
        lock.__enter__()  # Re-entered, as the runner and fit do.
        console.end_process(143)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 143, proc.stderr
    assert os.listdir(tmp_path / "run") == []
    lines = []
    with paths.model_dir_lock(str(tmp_path / "run"), lines.append):
        assert os.path.exists(tmp_path / "run" / paths.LOCK_FILE)
    assert lines == []
