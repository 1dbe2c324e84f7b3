"""The planner's compressed settings: bytes from the push rules, stream fetches."""

import re

import numpy as np
import pytest

from tf_distbelief.downpour import config as config_lib
from tf_distbelief.downpour import update_stream
from tf_distbelief.downpour.push_rules import reference
from tf_distbelief.planner import cost_model as cm
from tf_distbelief.planner import records

N = 1_000_000


def _rules_bytes(**fields):
    """What the push rules send for one push of an N-entry float32 tensor."""
    config = config_lib.DownpourConfig(n_fetch=16, n_push=16, **fields)
    return reference.push_nbytes(config.rules, [np.zeros(N, np.float32)])


def _cluster(workers):
    return records.Cluster(
        num_params=N,
        num_workers=workers,
        num_ps=1,
        worker_bits_per_sec=1e8,
        ps_bits_per_sec=1e8,
        compute_secs=0.01,
        overhead_bytes=0,
    )


def test_a_compressed_push_moves_what_its_rules_code():
    setting = records.Setting.parse("n=16+outer+topk=0.01+q2")
    assert (setting.top_k_fraction, setting.quantize_bits) == (0.01, 2)
    assert setting.name == "n=16+outer+topk=0.01+q2"
    want = _rules_bytes(
        outer_learning_rate=0.35,
        outer_momentum=0.9,
        top_k_fraction=0.01,
        quantize_bits=2,
    )
    traffic = cm.step_traffic(setting, N, overhead_bytes=0, num_workers=4)
    assert traffic.to_ps_bytes == want / 16
    # Update-stream fetches: 4 replicas' pushes per 16 steps, each as pushed.
    assert traffic.to_worker_bytes == 4 * want / 16
    # One replica fetches only its own push's index back.
    alone = cm.step_traffic(setting, N, overhead_bytes=0, num_workers=1)
    assert alone.to_worker_bytes == 0


def test_without_the_outer_rule_a_compressed_setting_fetches_the_model():
    setting = records.Setting.parse("n=16+topk=0.01", accumulator="mean")
    traffic = cm.step_traffic(setting, N, overhead_bytes=0, num_workers=8)
    rules_bytes = _rules_bytes(top_k_fraction=0.01, adagrad_accumulator="mean")
    assert traffic.to_ps_bytes == rules_bytes / 16
    assert traffic.to_worker_bytes == 4 * N / 16


def test_the_stream_grows_with_the_replicas():
    """Each replica fetches every replica's pushes: with `n_fetch == n_push`
    (the only way a compressed push runs with the outer rule) replicas at
    equal speed stay within the log's window (`update_stream.stream_window`:
    4 rounds of every replica's pushes, at least 64) at any count."""
    setting = records.Setting.parse("n=16+outer+topk=0.01+q2")
    push = cm.step_traffic(setting, N, overhead_bytes=0, num_workers=2).to_ps_bytes
    for workers in (64, 200):
        at = cm.step_traffic(setting, N, overhead_bytes=0, num_workers=workers)
        assert at.to_worker_bytes == workers * push
    assert [update_stream.stream_window(w) for w in (1, 16, 17, 200)] == [
        64,
        64,
        68,
        800,
    ]
    slow = cm.predict(_cluster(64), setting)
    fast = cm.predict(_cluster(2), setting)
    assert slow.examples_per_sec < 32 * fast.examples_per_sec


def test_the_stream_window_refuses_a_replica_count_below_one():
    with pytest.raises(ValueError, match=r"`num_workers` must be >= 1.*Received: 0"):
        update_stream.stream_window(0)


@pytest.mark.parametrize(
    "fields, rule",
    [
        (dict(n_fetch=None, n_push=None, top_k_fraction=0.01), "need Downpour"),
        (dict(n_fetch=16, n_push=16, top_k_fraction=1.5), "top_k_fraction"),
        (dict(n_fetch=16, n_push=16, quantize_bits=3), "quantize_bits"),
        (dict(n_fetch=16, n_push=16, top_k_fraction=0.01), "adagrad_accumulator"),
    ],
)
def test_bad_compression_is_refused_naming_the_value(fields, rule):
    with pytest.raises(ValueError, match=rule):
        records.Setting(**fields)


@pytest.mark.parametrize(
    "name", ["n=16+q", "n=16+topk=", "n=16+topk=x", "n=16+q2+outer", "n=0", "stock+q2"]
)
def test_a_bad_setting_name_is_refused(name):
    with pytest.raises(ValueError, match="topk=<f>"):
        records.Setting.parse(name)


def test_the_command_line_adds_compressed_rows(capsys):
    from tf_distbelief.planner import __main__ as cli

    argv = ["--params=1M", "--workers=4", "--nic=100mbit", "--step_ms=10"]
    assert cli.main(argv + ["--settings=n=16+outer+topk=0.01+q2, n=32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("n=16+outer+topk=0.01+q2 "))
    setting = records.Setting.parse("n=16+outer+topk=0.01+q2")
    traffic = cm.step_traffic(setting, N, 1, records.DEFAULT_OVERHEAD_BYTES, 4)
    # MB per step fetched and pushed, as `step_traffic` gives them.
    assert row.split()[-3:-1] == [
        f"{traffic.to_worker_bytes / 1e6:.3f}",
        f"{traffic.to_ps_bytes / 1e6:.3f}",
    ]
    assert any(line.startswith("n=32 ") for line in lines)


@pytest.mark.parametrize(
    "settings, message",
    [
        (  # Named as written, not by `Setting`'s field names.
            "n=16+outer+topk=2+q2",
            r"`--settings` has 'n=16\+outer\+topk=2\+q2': `\+topk=<f>` must be in "
            r"\(0, 1\].*Received: 2.0",
        ),
        (  # The range's message, not the grammar's.
            "n=16+outer+topk=-1",
            r"`\+topk=<f>` must be in \(0, 1\].*Received: -1.0",
        ),
        ("n=16+outer+topk=nan", r"`\+topk=<f>` must be finite.*Received: nan"),
        ("n=16+q3", r"`\+q<bits>` must be one of 0 \(off\), 2, 8. Received: 3"),
        ("n=16+topk=0.01", r"`\+topk=<f>` needs `--accumulator` 'mean' or 'sum'"),
        ("n=32,,n=8", r"`--settings` has an empty entry: 'n=32,,n=8'"),
        (
            "n=8+outer+topk=0.01+q2,n=8+outer+topk=1e-2+q2",
            r"'n=8\+outer\+topk=1e-2\+q2', named twice \(n=8\+outer\+topk=0.01\+q2\)",
        ),
        ("n=16+outer", r"'n=16\+outer', a standard row \(n=16\+outer\)"),
        ("n=1+outer+topk=0.01", r"`\+outer` needs `n` >= 2 \(local rounds\)"),
    ],
)
def test_the_command_line_refuses_a_bad_settings_entry(capsys, settings, message):
    from tf_distbelief.planner import __main__ as cli

    argv = ["--params=1M", "--workers=4", "--step_ms=10", f"--settings={settings}"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, err), err
    assert "Argument" not in err and "top_k_fraction" not in err
