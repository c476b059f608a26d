"""A producer at its fd limit (EMFILE) costs no CPU while idle, and listens again once fds
are free (issue 13, finding 6).

The producer runs in its own process, which lowers RLIMIT_NOFILE and fills every fd left.
Connections then wait in both listeners' backlogs (the ZMQ side channel and the data
port), so each accept() fails; the process's CPU time over 2 s is what that costs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import zmq

from connectors.zmq.control import framing, wire
from connectors.zmq.control.wire import MsgType

CHILD = textwrap.dedent("""
    import json, os, resource, sys, time
    from connectors.zmq.producer.producer import Producer, ProducerConfig
    from pd.engine.kv.page_pool import PagePool

    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    p = Producer(ProducerConfig(engine_id="p-emfile", secret=b"emfile-secret-0123456789", compat_hash="c" * 64,
                                handshake_timeout_s=2.0), PagePool(4, 4096))
    p.start()
    print(json.dumps({"port": p.port, "data_port": p.data_port}), flush=True)
    sys.stdin.readline()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    fds = []
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print(json.dumps({"filled": len(fds)}), flush=True)
    sys.stdin.readline()  # the parent's connections wait in both backlogs
    time.sleep(0.5)
    t0 = cpu()
    time.sleep(2.0)
    spent = cpu() - t0
    for fd in fds:
        os.close(fd)
    print(json.dumps({"cpu_s": spent, "stats": p.metrics.snapshot()}), flush=True)
    sys.stdin.readline()
    p.shutdown()
""")


def _line(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "the producer process did not answer"
    line = proc.stdout.readline()
    assert line, f"the producer process exited (rc={proc.poll()})"
    return json.loads(line)


def _connect_waiting(port: int, num_connections: int) -> list[socket.socket]:
    """Up to `num_connections` connections left waiting in a listener's backlog. The side channel's
    guard answers a failed accept by unbinding its endpoint (seen even before the first of these
    connections landed), so a connect there may be refused or reset until it binds again. That
    refusal is the state under test, not a failure: keep what landed."""
    conns: list[socket.socket] = []
    for _ in range(num_connections):
        try:
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except (ConnectionRefusedError, ConnectionResetError):
            break
    return conns


def test_emfile_on_the_listeners_costs_no_cpu_at_idle(fault_record):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    conns: list[socket.socket] = []
    try:
        ports = _line(proc)
        proc.stdin.write("fill\n")
        proc.stdin.flush()
        assert _line(proc)["filled"] > 0
        conns += _connect_waiting(ports["data_port"], 4)
        assert conns, "no connection reached the data port (its listener never closes)"
        conns += _connect_waiting(ports["port"], 4)
        proc.stdin.write("measure\n")
        proc.stdin.flush()
        measured = _line(proc, timeout_s=30)
        for s in conns:
            s.close()
        # The fds are free again: both listeners serve strangers again (within their back-off).
        deadline = time.monotonic() + 15
        nonce = None
        while nonce is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", ports["data_port"]), timeout=2) as s:
                    s.settimeout(2)
                    nonce = framing.recv_frame(s)[0]
            except OSError:
                time.sleep(0.2)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{ports['port']}")
        answer = None
        while answer is None and time.monotonic() < deadline:
            dealer.send(wire.encode(MsgType.HELLO, engine_id="d", expect_engine_id="p-emfile", compat="c" * 64,
                                    nonce=b"n" * 16))
            if dealer.poll(1000):
                answer = wire.decode(dealer.recv())[0]
        dealer.close()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(20) == 0
    finally:
        for s in conns:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    cpu_s = measured["cpu_s"]
    assert cpu_s < 0.3, f"{cpu_s:.2f} s of CPU in 2 s at the fd limit: a listener spins"
    assert measured["stats"]["accept_backoffs"] >= 2, measured["stats"]  # both listeners backed off
    assert nonce is MsgType.NONCE and answer is MsgType.CHALLENGE, (nonce, answer)
    fault_record(fault="EMFILE on both listeners (fds exhausted, connections waiting)", where="P side channel / data port",
                 user_saw="-", pdkv_did=f"{cpu_s:.3f} s CPU in 2 s idle (listeners back off); listening again after",
                 pools="-")


def test_the_side_channel_caps_its_connections():
    """libzmq has no connection cap: the producer's guard shuts connections past
    `max_side_connections`; the ones it kept are answered."""
    from connectors.zmq.producer.producer import Producer, ProducerConfig
    from pd.engine.kv.page_pool import PagePool

    p = Producer(ProducerConfig(engine_id="p-cap", secret=b"cap-secret-0123456789", compat_hash="c" * 64,
                                max_side_connections=4), PagePool(4, 4096))
    p.start()
    ctx, dealers = zmq.Context.instance(), []
    try:
        for _ in range(10):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RECONNECT_IVL, 10_000)  # a shut one stays away during the test
            d.connect(f"tcp://127.0.0.1:{p.port}")
            dealers.append(d)
        deadline = time.monotonic() + 10
        while p.metrics.snapshot()["handshakes_refused"].get("capacity", 0) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        for d in dealers:
            d.send(wire.encode(MsgType.HELLO, engine_id="d", expect_engine_id="p-cap", compat="c" * 64, nonce=b"n" * 16))
        answered = sum(1 for d in dealers if d.poll(1000) and d.recv())
        assert answered == 4, answered
        assert p.metrics.snapshot()["handshakes_refused"].get("capacity", 0) == 6
    finally:
        for d in dealers:
            d.close()
        p.shutdown()
