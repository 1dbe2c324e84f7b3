"""`/proc/<pid>/stat`, read by one module (`cluster.local.proc_stat`): a real
child process, whose command name holds a space and a parenthesis."""

import os
import subprocess
import sys

import pytest

from tf_distbelief.cluster.local import proc_stat


def test_a_process_is_known_by_its_start_until_it_ends(tmp_path):
    program = tmp_path / "a b) (c"
    program.symlink_to(sys.executable)
    child = subprocess.Popen([str(program), "-c", "import time; time.sleep(30)"])
    try:
        fields = proc_stat.fields(child.pid)
        assert fields[0] in "RSD"  # The state, after the command name.
        start = proc_stat.start_ticks(child.pid)
        assert start == int(fields[proc_stat.START_FIELD])
        assert start >= proc_stat.start_ticks()  # Started after this process.
        assert proc_stat.start_ticks("self") == proc_stat.start_ticks(os.getpid())
        assert all(int(fields[i]) >= 0 for i in proc_stat.CPU_FIELDS)
    finally:
        child.kill()
        child.wait()
    assert proc_stat.start_ticks(child.pid) is None
    with pytest.raises(FileNotFoundError):
        proc_stat.fields(child.pid)
