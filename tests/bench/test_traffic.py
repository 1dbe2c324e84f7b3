"""The socket-byte parser and attribution of `benchmarks.traffic`.

Pure functions on captured `ss -tinpH state established` text; no cluster.
"""

from __future__ import annotations

import pytest

from benchmarks import traffic

# Captured on a LocalCluster (2 workers, 1 ps) during the benchmark, info lines
# cut short: a worker (pid 15955) connected to the ps (port 45919, pid 15956),
# the ps's end of that connection, the chief (pid 15934) connected to the ps,
# and a connection into the worker's server port 38623.
SAMPLE = """\
0      0      [::ffff:127.0.0.1]:47858 [::ffff:127.0.0.1]:45919 users:(("server_main.py",pid=15955,fd=10))
\t bbr wscale:10,10 rto:204 rtt:0.859/1.029 ato:40 mss:55296 pmtu:65535 rcvmss:65483 advmss:65483 cwnd:26 ssthresh:8 bytes_sent:962738 bytes_acked:962739 bytes_received:1739478062 segs_out:6984 segs_in:29581 data_segs_out:3087 data_segs_in:29265
0      0      [::ffff:127.0.0.1]:51840 [::ffff:127.0.0.1]:45919 users:(("downpour_traffic.",pid=15934,fd=11))
\t bbr wscale:10,10 rto:216 rtt:12.253/18.623 ato:40 mss:65483 pmtu:65535 rcvmss:536 advmss:65483 cwnd:12 ssthresh:8 bytes_sent:38638588 bytes_acked:38638589 bytes_received:105762 segs_out:3026 segs_in:2548
0      0      [::ffff:127.0.0.1]:45919 [::ffff:127.0.0.1]:47858 users:(("server_main.py",pid=15956,fd=10))
\t bbr wscale:10,10 rto:204 rtt:0.944/0.815 ato:40 mss:65483 pmtu:65535 rcvmss:4667 advmss:65483 cwnd:42 ssthresh:49 bytes_sent:1740787722 bytes_retrans:1309660 bytes_acked:1739478062 bytes_received:962738 segs_out:29580 segs_in:6984
0      0      [::ffff:127.0.0.1]:38623 [::ffff:127.0.0.1]:39540 users:(("server_main.py",pid=15955,fd=8))
\t bbr wscale:10,10 rto:208 rtt:5.296/10.004 ato:40 mss:65483 pmtu:65535 rcvmss:65483 advmss:65483 cwnd:22 bytes_sent:430870 bytes_acked:430870 bytes_received:48274466 segs_out:6458 segs_in:7385
"""  # noqa: E501

WORKER, PS, CHIEF = 15955, 15956, 15934


def test_parse_ss_captured_sample():
    sockets = traffic.parse_ss(SAMPLE)
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
    one, two = traffic.parse_ss(text)
    assert (one.local, one.peer, one.pids) == (("::1", 5000), ("::1", 6000), (1, 2))
    # `ss` leaves out counters that are 0.
    assert (one.bytes_acked, one.bytes_received) == (7, 0)
    assert (two.pids, two.bytes_acked, two.bytes_received) == ((), 0, 0)
    assert traffic.parse_ss("") == []


def _socket(local_port, peer_port, pid, acked, received):
    return traffic.TcpSocket(
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
    link = traffic.link_bytes(before, after, [WORKER], [PS])
    # Worker-side view: sent = 200 + 50 + 40, received = 4000 + 100 + 60.
    assert (link.sent, link.received) == (290, 4160)
    assert link.total == 4450
    # Seen from the ps the same bytes flow the other way.
    reverse = traffic.link_bytes(before, after, [PS], [WORKER])
    assert (reverse.sent, reverse.received) == (4160, 290)
    chief = traffic.link_bytes(before, after, [CHIEF], [PS, WORKER])
    assert (chief.sent, chief.received) == (994, 994)


def test_link_bytes_peer_by_listening_port_and_restarted_counters():
    # The ps end is not visible (no pid): attributed by its listening port.
    after = [_socket(40000, 45919, WORKER, 500, 700)]
    before = [_socket(40000, 45919, WORKER, 100, 200)]
    assert traffic.link_bytes(before, after, [WORKER], [PS]).total == 0
    link = traffic.link_bytes(before, after, [WORKER], [PS], peer_ports={45919: PS})
    assert (link.sent, link.received) == (400, 500)
    # A reused 4-tuple whose counters went down is a new connection.
    smaller = [_socket(40000, 45919, WORKER, 50, 60)]
    link = traffic.link_bytes(after, smaller, [WORKER], [PS], peer_ports={45919: PS})
    assert (link.sent, link.received) == (50, 60)


def test_link_bytes_on_the_captured_sample():
    sockets = traffic.parse_ss(SAMPLE)
    link = traffic.link_bytes([], sockets, [WORKER], [PS])
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
    assert traffic.parse_endpoint(text) == endpoint
