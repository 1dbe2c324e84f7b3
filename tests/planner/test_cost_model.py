"""The planner's cost model and command line: hand-computed predictions."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_distbelief.planner import cost_model as cm
from tf_distbelief.planner import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cluster(**changes):
    """1M parameters (4 MB), 2 workers, 1 ps, 1 Gbit/s, 10 ms a step."""
    values = dict(
        num_params=1_000_000,
        num_workers=2,
        num_ps=1,
        worker_bits_per_sec=1e9,
        ps_bits_per_sec=1e9,
        compute_secs=0.01,
        batch_size=32,
        steps_per_execution=20,
        function_secs=0.01,
        overhead_bytes=2048,
    )
    values.update(changes)
    return records.Cluster(**values)


def test_stock_is_limited_by_the_worker_nic():
    p = cm.predict(_cluster(), records.Setting.parse("stock"))
    # 4,000,000 model bytes + 2,048 overhead each way, one exchange a step.
    assert (p.traffic.to_worker_bytes, p.traffic.to_ps_bytes) == (4_002_048,) * 2
    t = 8 * 4_002_048 / 1e9  # 32.016 ms each way.
    assert p.transfer_secs == pytest.approx(2 * t)
    # Each transfer meets the other worker's, at independent times, on the
    # one ps NIC's direction: T = a + 2 t^2 / T (as Downpour's, below).
    a = 0.01 + 2 * t
    step = (a + math.sqrt(a * a + 8 * t * t)) / 2  # 95.5 ms.
    assert p.queue_secs == pytest.approx(step - a)  # 21.5 ms.
    assert p.examples_per_sec == pytest.approx(2 * 32 / step)  # 670.2
    assert p.bottleneck == "worker NIC"
    assert p.bounds[cm.PS_NIC] == pytest.approx(1e9 * 32 / (8 * 4_002_048))  # 999.5
    assert p.bounds[cm.CHIEF] == pytest.approx(20 * 32 / 0.01)


def test_downpour_squares_push_twice_the_model_and_the_outer_rule_once():
    p = cm.predict(_cluster(), records.Setting.parse("n=16"))
    # Fetch 4e6/16, push 2 x 4e6/16, overhead 2048/16 a step each way.
    assert p.traffic.to_worker_bytes == pytest.approx(250_128)
    assert p.traffic.to_ps_bytes == pytest.approx(500_128)
    # Each transfer stretched by the other worker's expected share of the
    # one ps NIC's direction: T = a + (t_f^2 + t_p^2) / T (equal NICs, 1 ps).
    t_f, t_p = 8 * 250_128 / 1e9, 8 * 500_128 / 1e9
    a = 0.01 + t_f + t_p
    step = (a + math.sqrt(a * a + 4 * (t_f**2 + t_p**2))) / 2  # 17.17 ms.
    assert p.transfer_secs == pytest.approx(t_f + t_p)
    assert p.queue_secs == pytest.approx(step - a)  # 1.17 ms.
    assert p.examples_per_sec == pytest.approx(64 / step)  # 3,728
    assert p.bottleneck == "worker CPU"  # 7.2 ms of transfer and wait < 10 ms.
    assert p.bounds[cm.PS_NIC] == pytest.approx(32e9 / (8 * 500_128))
    outer = cm.predict(_cluster(), records.Setting.parse("n=16+outer"))
    assert outer.traffic.to_ps_bytes == pytest.approx(250_128)
    a = 0.01 + 2 * t_f
    step = (a + math.sqrt(a * a + 8 * t_f**2)) / 2
    assert outer.examples_per_sec == pytest.approx(64 / step)
    # n_push = 1 sends no squares; "mean" never does.
    assert records.Setting(1, 1).push_copies == 1
    assert records.Setting(4, 4, accumulator="mean").push_copies == 1
    assert records.Setting(4, 1).exchanges_per_step == 1.0


def test_workers_queue_at_the_ps_unless_alone_or_unlimited():
    # Exchanges every step queue as well (stock above; n = 1 moves the same
    # bytes); one worker or unlimited ps NICs have no one to wait for.
    stock = cm.predict(_cluster(), records.Setting.parse("stock"))
    assert cm.predict(
        _cluster(), records.Setting.parse("n=1")
    ).queue_secs == pytest.approx(stock.queue_secs)
    n4 = records.Setting.parse("n=4")
    assert cm.predict(_cluster(num_workers=1), n4).queue_secs == 0
    assert cm.predict(_cluster(ps_bits_per_sec=None), n4).queue_secs == 0
    # 8 workers, 2 ps, 1 Gbit/s NICs, n=4+outer: each worker moves 1,001,024 B
    # each way a step (1,000,000 + 2 x 2048 / 4), t = 8.008 ms at its NIC,
    # half of it through each ps; a ps NIC direction carries k = 2 such flows
    # at full rate. With 7 others, (1 + 7 t / T) / 2 > 1 while T < 7 t, so
    # T = a + 2 t ((1 + 7 t / T) / 2 - 1) = a - t + 7 t^2 / T.
    c = _cluster(num_workers=8, num_ps=2)
    p = cm.predict(c, records.Setting.parse("n=4+outer"))
    assert p.traffic.to_worker_bytes == pytest.approx(1_001_024)
    t = 8 * 1_001_024 / 1e9
    a = 0.01 + 2 * t
    step = ((a - t) + math.sqrt((a - t) ** 2 + 4 * 7 * t * t)) / 2  # 32.0 ms.
    assert step < 7 * t
    assert p.queue_secs == pytest.approx(step - a)  # 6.0 ms.
    assert p.bounds["workers"] == pytest.approx(8 * 32 / step)  # 7,994
    # Just above the ps NICs' own bound, 2e9 x 32 / (8 x 1,001,024) = 7,992.
    assert p.bounds[cm.PS_NIC] == pytest.approx(2e9 * 32 / (8 * 1_001_024))
    assert p.bottleneck == cm.PS_NIC
    # 4 ps carry k = 4 flows each: (1 + 7 t / T) / 4 <= 1 for T >= a, no wait.
    p4 = cm.predict(c.replace(num_ps=4), records.Setting.parse("n=4+outer"))
    assert p4.queue_secs == 0
    assert p4.bottleneck == cm.WORKER_NIC


def test_the_first_exchange_after_a_join_meets_every_worker():
    # n=16 (fetch t_f, push t_p a step, as above), joins every 64 steps: a
    # quarter of the exchanges follow a join and share the one ps NIC with
    # the other worker (wait t_f + t_p a step, amortised), the rest spread:
    # T = a + f (t_f + t_p) + (1 - f) (t_f^2 + t_p^2) / T, f = 16 / 64.
    n16 = records.Setting.parse("n=16")
    t_f, t_p = 8 * 250_128 / 1e9, 8 * 500_128 / 1e9
    a = 0.01 + t_f + t_p
    b, f = a + 0.25 * (t_f + t_p), 0.25
    step = (b + math.sqrt(b * b + 4 * (1 - f) * (t_f**2 + t_p**2))) / 2  # 18.32 ms.
    p = cm.predict(_cluster(steps_between_joins=64), n16)
    assert p.queue_secs == pytest.approx(step - a)
    assert p.examples_per_sec == pytest.approx(64 / step)  # 3,493
    # A join before every exchange: every one shares the NIC.
    for joins in (16, 8):
        p = cm.predict(_cluster(steps_between_joins=joins), n16)
        assert p.queue_secs == pytest.approx(t_f + t_p)
    # Stock exchanges every step: joins every 4 steps align a quarter of them.
    t = 8 * 4_002_048 / 1e9
    a, f = 0.01 + 2 * t, 0.25
    b = a + f * 2 * t
    step = (b + math.sqrt(b * b + 4 * (1 - f) * 2 * t * t)) / 2  # 104.7 ms.
    stock = cm.predict(_cluster(steps_between_joins=4), records.Setting.parse("stock"))
    assert stock.queue_secs == pytest.approx(step - a)  # 30.7 ms.
    # With no joins, as before.
    assert cm.predict(_cluster(steps_between_joins=None), n16) == cm.predict(
        _cluster(), n16
    )


def _mean_overlap(t, sd):
    """E[max(0, 1 - |d| / t)], d ~ N(0, sd^2), by numeric integration."""
    d = np.linspace(-t, t, 200_001)
    density = np.exp(-0.5 * (d / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
    return float(np.trapezoid((1 - np.abs(d) / t) * density, d))


def test_workers_in_step_after_a_join_drift_apart_by_their_step_jitter():
    # n=16, joins every 32 steps: two exchanges an interval. The first meets
    # the other worker at the ps NIC (wait t, as above); at the second the
    # two are d ~ N(0, 2 x 16 sigma^2) apart and a transfer of t seconds
    # meets the other's for E[max(0, 1 - |d| / t)] of its time (p, here
    # more than the t / T of independent times), waiting t p:
    # T = a + sum_d t_d (1 + p_d) / 2.
    n16 = records.Setting.parse("n=16")
    t_f, t_p = 8 * 250_128 / 1e9, 8 * 500_128 / 1e9
    a = 0.01 + t_f + t_p
    sigma = 0.0005
    sd = sigma * math.sqrt(2 * 16)
    p_f, p_p = _mean_overlap(t_f, sd), _mean_overlap(t_p, sd)  # 0.24, 0.45.
    step = a + t_f * (1 + p_f) / 2 + t_p * (1 + p_p) / 2  # 18.7 ms.
    assert p_f > t_f / step and p_p > t_p / step
    p = cm.predict(_cluster(steps_between_joins=32, step_jitter_secs=sigma), n16)
    assert p.queue_secs == pytest.approx(step - a, rel=1e-6)
    # No variation: the workers stay in step, every exchange waits t.
    still = cm.predict(_cluster(steps_between_joins=256, step_jitter_secs=0), n16)
    assert still.queue_secs == pytest.approx(t_f + t_p)
    # A large one: only the first exchange is in step (the default, None).
    loose = _cluster(steps_between_joins=256, step_jitter_secs=10.0)
    assert cm.predict(loose, n16).queue_secs == pytest.approx(
        cm.predict(loose.replace(step_jitter_secs=None), n16).queue_secs, rel=1e-3
    )
    # The jitter matters only with joins.
    assert cm.predict(_cluster(step_jitter_secs=0), n16) == cm.predict(_cluster(), n16)


def test_the_ps_nic_limits_many_workers():
    p = cm.predict(_cluster(num_workers=8), records.Setting.parse("stock"))
    assert p.bottleneck == "ps NIC"
    assert p.examples_per_sec == pytest.approx(32e9 / (8 * 4_002_048))
    # Two ps: each carries half the model and its own overhead.
    p2 = cm.predict(_cluster(num_workers=8, num_ps=2), records.Setting.parse("stock"))
    assert p2.bounds[cm.PS_NIC] == pytest.approx(2e9 * 32 / (8 * 4_004_096))


def test_the_chief_limits_short_functions_and_unlimited_nics_only_compute():
    c = _cluster(worker_bits_per_sec=None, ps_bits_per_sec=None)
    p = cm.predict(c, records.Setting.parse("stock"))
    assert (p.examples_per_sec, p.bottleneck) == (pytest.approx(6400), "worker CPU")
    assert math.isinf(p.bounds[cm.PS_NIC])
    p = cm.predict(c.replace(steps_per_execution=1), records.Setting.parse("n=4"))
    assert (p.examples_per_sec, p.bottleneck) == (
        pytest.approx(3200),
        "chief scheduling",
    )
    # 200 workers at 100 ms a step: 2,000 steps/s, 10 ms a function.
    c = _cluster(num_workers=200, compute_secs=0.1)
    assert cm.chief_steps_per_execution(c) == 20


def test_workers_on_one_host_share_its_cores():
    # 2 cores; the single process's step 10 ms on both: 20 core-ms of work.
    unlimited = _cluster(worker_bits_per_sec=None, ps_bits_per_sec=None)
    n4 = records.Setting.parse("n=4")
    shared = unlimited.replace(num_workers=1, host_cores=2)
    # One worker with every core computes as the single process does.
    alone = cm.predict(shared, n4)
    assert alone.compute_secs == 0.01
    assert alone.examples_per_sec == pytest.approx(3200)
    # With one core (one intra-op thread), twice as long.
    one_core = cm.predict(shared.replace(cores_per_worker=1), n4)
    assert one_core.compute_secs == pytest.approx(0.02)
    assert one_core.bottleneck == "worker CPU"
    # Two one-core workers on two cores: no contention, twice one's rate.
    two = cm.predict(shared.replace(num_workers=2, cores_per_worker=1), n4)
    assert two.examples_per_sec == pytest.approx(3200)
    # Compute only: 8 workers together run at the single process's rate,
    # each step stretched to 8 x 10 ms (x = 10 ms / (1 - 70 ms / T), T = x).
    eight = cm.predict(shared.replace(num_workers=8, cores_per_worker=1), n4)
    assert eight.compute_secs == pytest.approx(0.08)
    assert eight.examples_per_sec == pytest.approx(3200)
    assert eight.bottleneck == "host cores"
    # The workers' compute-only rate is the host's, and the chief keeps up
    # with 100 steps/s at 10 ms a function with one step each.
    assert cm.compute_only_rate(shared.replace(num_workers=8)) == pytest.approx(3200)
    assert cm.compute_only_rate(unlimited) == pytest.approx(6400)
    assert cm.chief_steps_per_execution(shared.replace(num_workers=8)) == 1
    # A transfer of t = 10 ms a step beside it (4 ps, no queueing at 8
    # workers): T = x + t, x = max(20, 10 / (1 - 70 / T)) ms, so
    # T^2 - 90 T + 700 = 0 (ms): T = 80.86 ms.
    rate = 8 * 4_000_000 * 2 / 4 / 0.01  # Bits/s moving 2 MB in 10 ms.
    networked = shared.replace(
        num_workers=8,
        cores_per_worker=1,
        num_ps=8,
        worker_bits_per_sec=rate,
        ps_bits_per_sec=rate,
        overhead_bytes=0,
    )
    p = cm.predict(networked, records.Setting.parse("n=4+outer"))
    step = (90 + math.sqrt(90 * 90 - 4 * 700)) / 2 / 1e3
    assert p.transfer_secs == pytest.approx(0.01)
    assert p.queue_secs == pytest.approx(0, abs=1e-9)
    assert p.compute_secs + p.transfer_secs == pytest.approx(step)
    assert p.examples_per_sec == pytest.approx(8 * 32 / step)
    # A host per task (the default): 8 workers compute at their own rate.
    assert cm.predict(unlimited.replace(num_workers=8), n4).examples_per_sec == (
        pytest.approx(8 * 3200)
    )


def test_smallest_ps_and_n():
    # 100 workers at 10 Gbit/s, ps at 1 Gbit/s: busy is 90% of 320,000 ex/s.
    # n=64+outer: ps bound 4e9 P / (62,500 + 32 P) >= 288,000 from P = 5.
    c = _cluster(num_workers=100, worker_bits_per_sec=1e10)
    setting = records.Setting.parse("n=64+outer")
    assert cm.smallest_ps(c, setting) == 5
    assert cm.predict(c.replace(num_ps=4), setting).bounds[cm.PS_NIC] < 288_000
    # Stock: 8 MB a step at 10 Gbit/s is 6.4 ms of transfer; never busy.
    assert cm.smallest_ps(c, records.Setting.parse("stock")) is None
    # 2 workers at 1 Gbit/s: busy needs <= 138,889 bytes a step:
    # (12e6 + 4096) / n without a rule (n >= 86.4), (8e6 + 4096) / n with it.
    assert cm.smallest_n(_cluster()) == 128
    assert cm.smallest_n(_cluster(), outer=True) == 64
    assert cm.plan(_cluster(), outer=True) == (64, 1)
    assert cm.plan(_cluster(), outer=True, busy_fraction=1.0) is None


@pytest.mark.parametrize(
    "value, count", [("42M", 42_000_000), ("2.4m", 2_400_000), ("500k", 500_000)]
)
def test_parse_count(value, count):
    assert cm.parse_count(value) == count


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: cm.parse_count("lots"), r"`params`.*'lots'"),
        (
            lambda: records.Setting.parse("n=0"),
            r"A setting must be stock.*Received: 'n=0'",
        ),
        (lambda: records.Setting(4, None), r"`n_fetch` and `n_push`"),
        (lambda: records.Setting(accumulator="cubes"), r"`accumulator`.*'cubes'"),
        (lambda: _cluster(num_ps=0), r"`num_ps` must be positive. Received: 0"),
        (lambda: _cluster(ps_bits_per_sec=-1), r"`ps_bits_per_sec`.*-1"),
        (lambda: _cluster(compute_secs=math.nan), r"`compute_secs`.*nan"),
        (lambda: _cluster(steps_between_joins=0), r"`steps_between_joins`.*: 0"),
        (lambda: _cluster(step_jitter_secs=-0.001), r"`step_jitter_secs`.*-0.001"),
        (lambda: _cluster(host_cores=0), r"`host_cores`.*: 0"),
        (lambda: _cluster(cores_per_worker=1), r"`cores_per_worker` needs"),
        (
            lambda: _cluster(host_cores=2, cores_per_worker=0.5),
            r"`cores_per_worker`.*0.5",
        ),
        (
            lambda: cm.smallest_ps(_cluster(), records.Setting(), 1.5),
            r"`busy_fraction`",
        ),
    ],
)
def test_bad_inputs_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _planner(*args):
    return subprocess.run(
        [sys.executable, "-m", "tf_distbelief.planner", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _table(*flags):
    """The planner's header line and its rows by name, for 1M parameters,
    2 workers, 1 Gbit/s, 10 ms a step, 20 steps a function, and `flags`."""
    proc = _planner(
        "--params=1M", "--workers=2", "--nic=1gbit", "--step_ms=10",
        "--steps_per_execution=20", *flags,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    return lines, {line.split()[0]: line.split() for line in lines[2:10]}


def test_command_line_prints_every_row_and_the_plan():
    lines, rows = _table()
    assert lines[0].startswith("params=1,000,000 (4.0 MB float32) workers=2 ps=1")
    assert list(rows) == [
        "stock", "n=1", "n=4", "n=4+outer", "n=16", "n=16+outer", "n=64",
        "n=64+outer",
    ]  # fmt: skip
    assert rows["stock"][1:4] == ["670", "worker", "NIC"]
    assert rows["n=16"][1:4] == ["3,728", "worker", "CPU"]
    assert "plan without a push rule: n_fetch = n_push = 128, num_ps = 1" in lines
    assert "plan with the outer rule: n_fetch = n_push = 64, num_ps = 1" in lines
    lines, rows = _table("--steps_between_joins=64")
    assert lines[0].endswith("accumulator=squares joins=every 64 steps")
    assert rows["n=16"][1:4] == ["3,493", "worker", "CPU"]
    assert rows["stock"][1:4] == ["666", "worker", "NIC"]
    # Workers that never drift apart: each n=16 exchange waits for the
    # other's, 64 / (10 ms + 2 (t_f + t_p)) = 2,909 ex/s; the wait equals
    # the worker's own transfer time (a tie: worker NIC).
    lines, rows = _table("--steps_between_joins=64", "--step_jitter_ms=0")
    assert lines[0].endswith("joins=every 64 steps step_jitter=0 ms")
    assert rows["n=16"][1:4] == ["2,909", "worker", "NIC"]
    # Both workers on one 2-core host, one core each: a one-core step of
    # 20 ms (the 10 ms given on both cores); no contention between two.
    lines, rows = _table("--host_cores=2", "--cores_per_worker=1")
    assert lines[0].endswith("host_cores=2 cores_per_worker=1")
    assert rows["n=64+outer"][1:4] == ["3,044", "worker", "CPU"]
    assert any("compute-only rate (3,200 ex/s)" in line for line in lines)


def test_command_line_refuses_bad_arguments():
    proc = _planner("--params=1M", "--workers=2", "--nic=fast", "--step_ms=10")
    assert proc.returncode == 2
    assert "`--nic` must be a rate" in proc.stderr
    proc = _planner("--params=1M", "--workers=0", "--step_ms=10")
    assert proc.returncode == 2
    assert "`--workers` must be positive. Received: 0" in proc.stderr
    proc = _planner(
        "--params=1M", "--workers=2", "--step_ms=10", "--steps_between_joins=0"
    )
    assert proc.returncode == 2
    assert "`--steps_between_joins` must be positive. Received: 0" in proc.stderr
    proc = _planner("--params=1M", "--workers=2", "--step_ms=10", "--step_jitter_ms=-2")
    assert proc.returncode == 2
    assert "`--step_jitter_ms` must be a finite number >= 0. Received: -2.0" in (
        proc.stderr
    )
    proc = _planner("--params=lots", "--workers=2", "--step_ms=10")
    assert proc.returncode == 2
    assert "error: `--params` must be a positive count such as 42M" in proc.stderr
