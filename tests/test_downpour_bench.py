"""The socket-byte parser and attribution of `benchmarks/downpour_bench.py`.

Pure functions on captured `ss -tinpH state established` text; no cluster.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
from absl import flags

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks",
    "downpour_bench.py",
)
_spec = importlib.util.spec_from_file_location("downpour_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("downpour_bench", bench)  # For its dataclasses.
_spec.loader.exec_module(bench)

# Captured on a LocalCluster (2 workers, 1 ps) during the benchmark, info lines
# cut short: a worker (pid 15955) connected to the ps (port 45919, pid 15956),
# the ps's end of that connection, the chief (pid 15934) connected to the ps,
# and a connection into the worker's server port 38623.
SAMPLE = """\
0      0      [::ffff:127.0.0.1]:47858 [::ffff:127.0.0.1]:45919 users:(("server_main.py",pid=15955,fd=10))
\t bbr wscale:10,10 rto:204 rtt:0.859/1.029 ato:40 mss:55296 pmtu:65535 rcvmss:65483 advmss:65483 cwnd:26 ssthresh:8 bytes_sent:962738 bytes_acked:962739 bytes_received:1739478062 segs_out:6984 segs_in:29581 data_segs_out:3087 data_segs_in:29265
0      0      [::ffff:127.0.0.1]:51840 [::ffff:127.0.0.1]:45919 users:(("downpour_bench.",pid=15934,fd=11))
\t bbr wscale:10,10 rto:216 rtt:12.253/18.623 ato:40 mss:65483 pmtu:65535 rcvmss:536 advmss:65483 cwnd:12 ssthresh:8 bytes_sent:38638588 bytes_acked:38638589 bytes_received:105762 segs_out:3026 segs_in:2548
0      0      [::ffff:127.0.0.1]:45919 [::ffff:127.0.0.1]:47858 users:(("server_main.py",pid=15956,fd=10))
\t bbr wscale:10,10 rto:204 rtt:0.944/0.815 ato:40 mss:65483 pmtu:65535 rcvmss:4667 advmss:65483 cwnd:42 ssthresh:49 bytes_sent:1740787722 bytes_retrans:1309660 bytes_acked:1739478062 bytes_received:962738 segs_out:29580 segs_in:6984
0      0      [::ffff:127.0.0.1]:38623 [::ffff:127.0.0.1]:39540 users:(("server_main.py",pid=15955,fd=8))
\t bbr wscale:10,10 rto:208 rtt:5.296/10.004 ato:40 mss:65483 pmtu:65535 rcvmss:65483 advmss:65483 cwnd:22 bytes_sent:430870 bytes_acked:430870 bytes_received:48274466 segs_out:6458 segs_in:7385
"""  # noqa: E501

WORKER, PS, CHIEF = 15955, 15956, 15934


def test_parse_ss_captured_sample():
    sockets = bench.parse_ss(SAMPLE)
    assert len(sockets) == 4
    first = sockets[0]
    assert first.local == ("127.0.0.1", 47858)
    assert first.peer == ("127.0.0.1", 45919)
    assert first.pids == (WORKER,)
    # `bytes_acked`, not `bytes_sent`, and not `bytes_retrans`.
    assert (first.bytes_acked, first.bytes_received) == (962739, 1739478062)
    assert sockets[2].bytes_acked == 1739478062
    assert [s.pids for s in sockets] == [(WORKER,), (CHIEF,), (PS,), (WORKER,)]


def test_parse_ss_missing_counters_ipv6_and_shared_sockets():
    text = (
        '0 0 [::1]:5000 [::1]:6000 users:(("a",pid=1,fd=3),("b",pid=2,fd=4))\n'
        "\t cubic rto:204 bytes_acked:7\n"
        "0 0 10.0.0.1:80 10.0.0.2:81\n"
        "\t cubic rto:204\n"
    )
    one, two = bench.parse_ss(text)
    assert (one.local, one.peer, one.pids) == (("::1", 5000), ("::1", 6000), (1, 2))
    # `ss` leaves out counters that are 0.
    assert (one.bytes_acked, one.bytes_received) == (7, 0)
    assert (two.pids, two.bytes_acked, two.bytes_received) == ((), 0, 0)
    assert bench.parse_ss("") == []


def _socket(local_port, peer_port, pid, acked, received):
    return bench.TcpSocket(
        ("127.0.0.1", local_port), ("127.0.0.1", peer_port), (pid,), acked, received
    )


def _both_ends(client_port, client_pid, server_port, server_pid, up, down):
    """A connection from both ends: the client sent `up`, received `down`."""
    return [
        _socket(client_port, server_port, client_pid, up, down),
        _socket(server_port, client_port, server_pid, down, up),
    ]


def test_link_bytes_counts_each_connection_once_in_both_directions():
    before = (
        _both_ends(40000, WORKER, 45919, PS, up=100, down=1000)  # worker -> ps
        + _both_ends(40001, PS, 38623, WORKER, up=10, down=20)  # ps -> worker
        + _both_ends(40002, CHIEF, 45919, PS, up=5, down=5)  # chief -> ps
    )
    after = (
        _both_ends(40000, WORKER, 45919, PS, up=300, down=5000)
        + _both_ends(40001, PS, 38623, WORKER, up=110, down=70)
        + _both_ends(40002, CHIEF, 45919, PS, up=999, down=999)
        # Opened during the interval: counted from 0.
        + _both_ends(40003, WORKER, 45919, PS, up=40, down=60)
    )
    link = bench.link_bytes(before, after, [WORKER], [PS])
    # Worker-side view: sent = 200 + 50 + 40, received = 4000 + 100 + 60.
    assert (link.sent, link.received) == (290, 4160)
    assert link.total == 4450
    # Seen from the ps the same bytes flow the other way.
    reverse = bench.link_bytes(before, after, [PS], [WORKER])
    assert (reverse.sent, reverse.received) == (4160, 290)
    chief = bench.link_bytes(before, after, [CHIEF], [PS, WORKER])
    assert (chief.sent, chief.received) == (994, 994)


def test_link_bytes_peer_by_listening_port_and_restarted_counters():
    # The ps end is not visible (no pid): attributed by its listening port.
    after = [_socket(40000, 45919, WORKER, 500, 700)]
    before = [_socket(40000, 45919, WORKER, 100, 200)]
    assert bench.link_bytes(before, after, [WORKER], [PS]).total == 0
    link = bench.link_bytes(before, after, [WORKER], [PS], peer_ports={45919: PS})
    assert (link.sent, link.received) == (400, 500)
    # A reused 4-tuple whose counters went down is a new connection.
    smaller = [_socket(40000, 45919, WORKER, 50, 60)]
    link = bench.link_bytes(after, smaller, [WORKER], [PS], peer_ports={45919: PS})
    assert (link.sent, link.received) == (50, 60)


def test_link_bytes_on_the_captured_sample():
    sockets = bench.parse_ss(SAMPLE)
    link = bench.link_bytes([], sockets, [WORKER], [PS])
    # Only the worker's connection to the ps; its server-port connection has
    # no visible peer in the sample.
    assert (link.sent, link.received) == (962739, 1739478062)


@pytest.mark.parametrize(
    "text, endpoint",
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::ffff:127.0.0.1]:45919", ("127.0.0.1", 45919)),
        ("[fe80::1%eth0]:22", ("fe80::1", 22)),
    ],
)
def test_endpoint(text, endpoint):
    assert bench._endpoint(text) == endpoint


def _row(name, rate, sock, acc, model="speech"):
    return bench.Row(
        model=model,
        name=name,
        examples_per_sec=rate,
        socket_bytes_per_example=sock,
        tensor_bytes_per_example=sock,
        cpu_ms_per_step={"worker": 1.0, "ps": 0.5},
        test_accuracy=acc,
        test_loss=1.0,
        wall_secs=2.0,
    )


def test_median_rows_and_table_ratios():
    rows = [
        _row("stock", 100, 1000, 0.90),
        _row("n=16", 250, 60, 0.89),
        _row("stock", 120, 1000, 0.92),
        _row("n=16", 200, 70, 0.88),
        _row("stock", 80, 1000, 0.91),
        _row("n=16", 300, 65, 0.87),
    ]
    stock, n16 = bench.median_rows(rows)
    assert (stock.name, stock.examples_per_sec, stock.test_accuracy) == (
        "stock",
        100,
        0.91,
    )
    assert (n16.examples_per_sec, n16.socket_bytes_per_example) == (250, 65)
    assert n16.wall_secs == 6.0
    lines = bench.format_table([stock, n16], "header").splitlines()
    assert lines[0] == "header"
    assert lines[1].split()[:4] == ["model", "config", "ex/s", "x"]
    fields = lines[3].split()
    # ex/s, x stock, sock B/ex, tensor B/ex, B x stock, CPU ms/step.
    assert fields[:8] == ["speech", "n=16", "250", "2.50", "65", "65", "0.065", "1.5"]


def test_speedup_is_the_median_of_per_round_ratios():
    """Round by round: 2.6, 2.0, 3.0 (median 2.6); the medians' ratio is 2.4."""
    rows = []
    for stock_rate, rate in ((100, 260), (120, 240), (80, 240)):
        rows += [_row("stock", stock_rate, 1000, 0.9), _row("n=4", rate, 250, 0.9)]
    stock, n4 = bench.median_rows(rows)
    assert stock.speedup == 1.0
    assert n4.speedup == pytest.approx(2.6)
    assert n4.examples_per_sec / stock.examples_per_sec == pytest.approx(2.4)
    fields = bench.format_table([stock, n4], "header").splitlines()[3].split()
    assert fields[:4] == ["speech", "n=4", "240", "2.60"]


def test_to_target_interpolates_seconds_and_examples():
    curve = [(0.0, 0.0), (2.0, 0.25), (6.0, 0.75), (7.0, 0.5)]
    secs, examples = bench.to_target(curve, 100, 0.5)
    # Halfway between the points at 2 s (100 examples) and 6 s (200).
    assert (secs, examples) == (4.0, 150.0)
    secs, examples = bench.to_target(curve, 100, 0.76)
    assert math.isnan(secs) and math.isnan(examples)


def test_median_rows_time_to_target_counts_unreached_rounds_as_slowest():
    rows = []
    for secs in (10.0, math.nan, 20.0):
        r = _row("n=16", 100, 60, 0.2)
        r.secs_to_target = secs
        r.examples_to_target = secs * 100
        r.reached = int(not math.isnan(secs))
        r.target = 0.15
        rows.append(r)
    (row,) = bench.median_rows(rows)
    # Sorted 10, 20, not reached: the median is 20.
    assert row.secs_to_target == 20.0
    assert row.examples_to_target == 2000.0
    assert (row.reached, row.rounds, row.target) == (2, 3, 0.15)
    low, high = row.spread["secs_to_target"]
    assert low == 10.0 and math.isnan(high)
    # Two rounds of three not reached: the median is not reached.
    rows[0].secs_to_target = math.nan
    assert math.isnan(bench.median_rows(rows)[0].secs_to_target)


def test_headline_ratios_to_stock_single_and_n1():
    rows = []
    for name, secs, rate, sock, acc in (
        ("single", 10.0, 4000, 0, 0.30),
        ("stock", 40.0, 1000, 1000, 0.28),
        ("n=1", 38.0, 1050, 1000, 0.27),
        ("n=16", 12.0, 3000, 100, 0.26),
    ):
        r = _row(name, rate, sock, acc)
        r.secs_to_target, r.examples_to_target, r.target = secs, secs * rate, 0.2
        r.reached = 1
        rows.append(r)
    rows = bench.median_rows(rows)
    lines = bench.format_headline(rows, "header").splitlines()
    assert lines[0] == "header"
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    # model, row, target, secs [min-max], examples, reached, x stock, x single,
    # final acc, acc vs n=1, ex/s, x stock ex/s, x single ex/s, B/ex, B x stock.
    assert cells[:3] == ["speech", "n=16", "0.200"]
    assert cells[3] == "12.0 [12.0-12.0]"
    assert cells[5:8] == ["1/1", "0.30", "1.20"]
    assert cells[9:] == ["-1.0", "3000", "3.00", "0.75", "100", "0.100"]
    stock = [c.strip() for c in lines[-3].strip("|").split("|")]
    assert stock[6:8] == ["1.00", "4.00"]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("single", ("single", None, None)),
        ("stock", ("stock", None, None)),
        ("n=4", ("downpour", 4, None)),
        ("n=16+outer", ("downpour", 16, "outer")),
        ("n=64+outer", ("downpour", 64, "outer")),
    ],
)
def test_row_kind(name, kind):
    assert bench._row_kind(name) == kind
    assert name in bench._known_rows()


def test_unknown_rows_are_refused_when_the_flags_are_parsed():
    assert bench._check_rows(["single", "n=64+outer"])
    with pytest.raises(flags.ValidationError, match=r"unknown \['n=128'\]; known: "):
        bench._check_rows(["n=16", "n=128"])
