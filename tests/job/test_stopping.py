"""`job.stopping.while_loading`: a signal while TensorFlow loads, in one line."""

import signal
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize(
    "sig, code, name",
    [(signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM")],
)
def test_a_signal_while_loading_ends_the_process_in_one_line(sig, code, name):
    program = textwrap.dedent(
        f"""
        import os, signal, time
        from tf_distbelief.job import stopping

        with stopping.while_loading():
            os.kill(os.getpid(), {int(sig)})
            time.sleep(30)  # The handler ends the process first.
        print("not reached")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr
    assert (
        proc.stdout
        == f"{name}: stopped while loading TensorFlow; nothing had started\n"
    )
    assert proc.stderr == ""


def test_the_handlers_before_the_block_are_put_back():
    program = textwrap.dedent(
        """
        import signal
        from tf_distbelief.job import stopping

        before = [signal.getsignal(s) for s in stopping.STOP_SIGNALS]
        with stopping.while_loading():
            during = [signal.getsignal(s) for s in stopping.STOP_SIGNALS]
        after = [signal.getsignal(s) for s in stopping.STOP_SIGNALS]
        print(before == after, during != before)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["True", "True"], proc.stderr
