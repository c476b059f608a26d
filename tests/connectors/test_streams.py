"""Data streams on real sockets: idle streams whose producer goes away, the one-read
frame paths (fixed-size PAGES, the producer's frame reader), refusals on the new paths."""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from connectors.zmq.control import framing, wire
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.metrics import FailureCause
from connectors.zmq.paths.page_access import digest
from pd.engine.kv.page_pool import PagePool
from connectors.zmq.producer.producer import Producer, ProducerConfig
from connectors.zmq.paths.base import PullPart
from connectors.zmq.consumer.pull_stream import PullStream
from connectors.zmq.control.session import ClientSession
from connectors.zmq.paths.staging_ring import StagingShape
from connectors.zmq.control.wire import MalformedMessage, MsgType

SECRET = b"stream-tests-secret-0123456789"
PAGE = 4096


class FakeProducer:
    """A data listener that accepts one tcp stream (NONCE, ATTACH -> ATTACHED) and then does what a test says."""

    def __init__(self):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.conn: socket.socket | None = None
        self.attached = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.srv.settimeout(10)
        conn, _ = self.srv.accept()
        conn.settimeout(10)
        framing.send_frame(conn, wire.encode(MsgType.NONCE, nonce=b"n" * 16))
        msg_type, _ = framing.recv_frame(conn)
        assert msg_type is MsgType.ATTACH
        framing.send_frame(conn, wire.encode(MsgType.ATTACHED, shm_name="", shm_bytes=0, chunk_pages=0))
        self.conn = conn
        self.attached.set()

    def close(self):
        for s in (self.conn, self.srv):
            if s is not None:
                framing.close_quietly(s)


def _open_stream(fake: FakeProducer, pool: PagePool) -> PullStream:
    stream = PullStream(pool, "127.0.0.1", fake.port, ClientSession(b"s" * 16, b"k" * 32), "tcp", io_timeout_s=2.0)
    assert fake.attached.wait(10)
    deadline = time.monotonic() + 5
    while not stream._ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert stream._ready and not stream.dead
    return stream


def _count_idle_waits(stream: PullStream) -> list[int]:
    calls = [0]
    inner = stream._idle_wait

    def counted():
        calls[0] += 1
        inner()

    stream._idle_wait = counted  # the thread looks the method up on every turn
    return calls


def _submit(stream: PullStream, src: list[int], dst: list[int]) -> tuple[PullPart, threading.Event]:
    ended = threading.Event()
    part = PullPart("r", src, dst, lambda p: ended.set())
    stream.submit(part)
    return part, ended


@pytest.mark.parametrize("how", ["close", "garbage"])
def test_idle_stream_whose_producer_closes_is_dropped_without_spinning(how):
    """The producer closes (or sends bytes nobody asked for) while the stream is idle: the
    stream becomes dead at once instead of waking on a readable socket forever, and a part
    submitted later fails cleanly (peer gone), its pages reported bad."""
    pool = PagePool(8, PAGE)
    fake = FakeProducer()
    stream = _open_stream(fake, pool)
    try:
        calls = _count_idle_waits(stream)
        time.sleep(0.05)
        before, cpu0 = calls[0], time.process_time()
        if how == "close":
            framing.close_quietly(fake.conn)
        else:
            fake.conn.sendall(b"\x00\x00\x00\x05hello")
        deadline = time.monotonic() + 5  # (a loaded machine may run the stream's thread late)
        while not stream.dead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.dead
        before, cpu0 = calls[0], time.process_time()
        time.sleep(0.3)
        spins, cpu = calls[0] - before, time.process_time() - cpu0
        assert spins <= 5, f"idle stream woke {spins} times in 0.3 s"  # the bug: ~10^5
        assert cpu < 0.2, f"{cpu:.2f} s of CPU in 0.3 s while idle"
        part, ended = _submit(stream, [1], [2])
        assert ended.wait(2)
        assert part.cause is FailureCause.PEER_GONE and part.bad_block_ids == [2]
    finally:
        stream.close()
        stream.join(5)
        fake.close()


def test_stream_answer_racing_the_idle_check_is_read_normally():
    """A part submitted while the stream thread sleeps: its answer makes the socket readable
    with a part queued, which is the normal path (not a stray byte)."""
    pool = PagePool(8, PAGE)
    fake = FakeProducer()
    stream = _open_stream(fake, pool)
    try:
        src = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
        for xfer in range(1, 4):
            part, ended = _submit(stream, [3], [xfer])
            msg_type, msg = framing.recv_frame(fake.conn)
            assert msg_type is MsgType.PULL and msg["xfer"] == xfer and msg["block_ids"] == [3]
            time.sleep(0.02)  # let the stream thread go back to sleep first
            fake.conn.sendall(wire.pages_frame(xfer, [digest(src.numpy())], PAGE) + src.numpy().tobytes())
            assert ended.wait(5) and part.cause is None, part
            assert torch.equal(pool.buffer[xfer], src)
        assert not stream.dead
    finally:
        stream.close()
        stream.join(5)
        fake.close()


@pytest.mark.parametrize("reason_len", [5, 200, 5000])
def test_refusal_of_any_size_is_read_whole_and_the_stream_stays_usable(reason_len):
    """The consumer sizes its first read for a PAGES frame; an ERROR frame shorter or longer
    than that is still read whole: the part fails as refused and the next part lands."""
    pool = PagePool(8, PAGE)
    fake = FakeProducer()
    stream = _open_stream(fake, pool)
    try:
        part, ended = _submit(stream, [1, 2], [4, 5])
        _, msg = framing.recv_frame(fake.conn)
        fake.conn.sendall(_frame(wire.encode(MsgType.ERROR, xfer=msg["xfer"], reason="x" * reason_len)))
        assert ended.wait(5) and part.cause is FailureCause.PULL_REFUSED and part.bad_block_ids == [4, 5]
        page = bytes(range(256)) * (PAGE // 256)
        part, ended = _submit(stream, [1], [6])
        _, msg = framing.recv_frame(fake.conn)
        fake.conn.sendall(wire.pages_frame(msg["xfer"], [digest(page)], PAGE) + page)
        assert ended.wait(5) and part.cause is None, part
        assert bytes(pool.buffer[6].numpy()) == page and not stream.dead
    finally:
        stream.close()
        stream.join(5)
        fake.close()


def test_pages_frame_of_the_wrong_size_breaks_the_stream():
    pool = PagePool(8, PAGE)
    fake = FakeProducer()
    stream = _open_stream(fake, pool)
    try:
        part, ended = _submit(stream, [1], [2])
        _, msg = framing.recv_frame(fake.conn)
        loose = wire.encode(MsgType.PAGES, xfer=msg["xfer"], digests=[7], page_bytes=PAGE)  # not the fixed layout
        fake.conn.sendall(_frame(loose) + b"\x00" * PAGE)
        assert ended.wait(5) and part.cause is FailureCause.PEER_GONE and part.bad_block_ids == [2]
        assert stream.dead
    finally:
        stream.close()
        stream.join(5)
        fake.close()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def test_hot_frames_are_plain_msgpack_of_the_announced_size():
    rng = random.Random(3)
    for n in (1, 2, 15, 16, 17, 300):
        digests = [rng.getrandbits(64) for _ in range(n)]
        digests[0] = rng.choice([0, 1, 2**64 - 1])
        frame = wire.pages_frame(2**33 + n, digests, 1 << 20)
        assert len(frame) == wire.pages_frame_size(n)
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        assert wire.decode(frame[4:]) == (MsgType.PAGES, {"v": wire.PROTOCOL_VERSION, "t": "pages", "xfer": 2**33 + n,
                                                          "page_bytes": 1 << 20, "digests": digests})
    for rid, ids in (("r", [3]), ("réq", [0, 5, 2**64 - 1]), ("x" * 70000, list(range(100)))):
        pull = wire.pull_frame(9, rid, ids)
        assert int.from_bytes(pull[:4], "big") == len(pull) - 4
        if len(rid) <= 0xFFFF:
            assert wire.decode(pull[4:]) == (MsgType.PULL, {"v": wire.PROTOCOL_VERSION, "t": "pull", "xfer": 9,
                                                            "request_id": rid, "block_ids": ids})
        else:  # too long for the producer: refused as malformed, as any such frame
            with pytest.raises(MalformedMessage):
                wire.decode(pull[4:])


def test_pages_shortcut_accepts_only_the_exact_frame_decode_would_read():
    """The consumer skips `decode` for a one-page PAGES frame that is byte for byte the one it
    asked for; whatever it accepts, `decode` reads the same; everything else goes to `decode`."""
    rng = random.Random(4)
    for _ in range(50):
        xfer, digests = rng.getrandbits(64), [rng.getrandbits(64)]
        frame = wire.pages_frame(xfer, digests, 4096)
        prefix = wire.pages_prefix(xfer, 1, 4096)
        assert wire.pages_digests(frame, prefix) == digests
        assert wire.pages_digests(frame, wire.pages_prefix(xfer ^ 1, 1, 4096)) is None
        assert wire.pages_digests(frame, wire.pages_prefix(xfer, 1, 8192)) is None
        assert wire.pages_digests(wire.pages_frame(xfer, digests * 2, 4096), wire.pages_prefix(xfer, 2, 4096)) is None
        mutants = [frame[:-1], frame + b"\x00"]
        for _ in range(60):
            i = rng.randrange(len(frame))
            mutants.append(frame[:i] + bytes([rng.randrange(256)]) + frame[i + 1 :])
        for m in mutants:
            got = wire.pages_digests(m, prefix)
            if got is not None:
                assert wire.decode(m[4:]) == (MsgType.PAGES, {"v": wire.PROTOCOL_VERSION, "t": "pages",
                                                              "xfer": xfer, "page_bytes": 4096, "digests": got})


def test_frame_reader_splits_joins_and_bounds_frames():
    a, b = socket.socketpair()
    with a, b:
        framing.kernel_timeouts(b, 0.05, 1.0)
        reader = framing.FrameReader(b, max_bytes=1 << 20, size=64)
        credit = _frame(wire.encode(MsgType.CREDIT, half=1))
        big = _frame(wire.encode(MsgType.ERROR, xfer=1, reason="y" * 1000))  # larger than the buffer
        a.sendall(credit + big + credit[:3])  # two and a bit frames in one go
        assert reader.read(1.0) == (MsgType.CREDIT, {"v": wire.PROTOCOL_VERSION, "t": "credit", "half": 1})
        assert reader.read(1.0)[1]["reason"] == "y" * 1000
        with pytest.raises(TimeoutError):  # a frame started and did not finish in time
            reader.read(0.1, idle=True)
        a.sendall(credit[3:])
        assert reader.read(1.0)[0] is MsgType.CREDIT
        with pytest.raises(framing.Idle):  # nothing started: idle, not a timeout of a frame
            reader.read(1.0, idle=True)
        a.sendall((2 << 20).to_bytes(4, "big"))
        with pytest.raises(MalformedMessage):
            reader.read(1.0)
        a.close()
        reader = framing.FrameReader(b)
        with pytest.raises(ConnectionError):
            reader.read(1.0)


def test_recv_scatter_reports_pieces():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2)
        bufs = [bytearray(3), bytearray(5), bytearray(4)]
        views = [memoryview(x) for x in bufs]
        a.sendall(b"abcdefg")
        gen = framing.recv_scatter(b, views)
        assert [next(gen), next(gen)] == [(0, 0, 3, 4), (1, 0, 4, 0)]
        a.sendall(b"hijkl")
        assert list(gen) == [(1, 4, 1, 4), (2, 0, 4, 0)]
        assert bytes(b"".join(bufs)) == b"abcdefghijkl"


def test_idle_session_whose_producer_goes_away_is_dropped_and_a_later_load_reconnects():
    """Real producer and consumer in one process: the producer shuts down while the
    consumer's streams are idle; the streams go dead without spinning, the session is
    dropped, a load meanwhile fails in bounded time, and once a producer is back on the
    same port the next load reconnects and lands."""
    src_pool, dst_pool = PagePool(16, PAGE), PagePool(16, PAGE)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(11))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c"), src_pool)
    prod.start()
    remote = RemoteAddr("P", "127.0.0.1", prod.port)
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path="tcp",
                                   handshake_timeout_s=1.0, transfer_timeout_s=10.0, io_timeout_s=1.0), dst_pool)
    cons.start()
    prod2 = None
    try:
        prod.add_lease("r0", [1, 2])
        job = cons.load("r0", remote, "r0", [1, 2], [3, 4])
        assert job.done.wait(10) and job.result.ok, job.result
        streams = list(cons._sessions[remote].streams)
        counts = [_count_idle_waits(s) for s in streams]
        time.sleep(0.05)
        before = sum(c[0] for c in counts)
        prod.shutdown()
        deadline = time.monotonic() + 5
        while not all(s.dead for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s.dead for s in streams)
        before = sum(c[0] for c in counts)
        time.sleep(0.3)
        assert sum(c[0] for c in counts) - before <= 5 * len(streams)
        deadline = time.monotonic() + 2
        while remote in cons._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remote not in cons._sessions, "the consumer kept a session whose streams are dead"
        t0 = time.monotonic()
        job = cons.load("r1", remote, "r1", [5], [6])  # nobody listens: the handshake times out
        assert job.done.wait(10) and not job.result.ok and job.result.invalid_block_ids == [6]
        # the handshake's 1 s ends it, well before the 10 s transfer timeout
        assert job.result.cause is FailureCause.TIMEOUT and time.monotonic() - t0 < 8
        prod2 = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", port=remote.port), src_pool)
        prod2.start()
        prod2.add_lease("r2", [7, 8])
        job = cons.load("r2", remote, "r2", [7, 8], [9, 10])
        assert job.done.wait(10) and job.result.ok, job.result
        assert torch.equal(dst_pool.buffer[[9, 10]], src_pool.buffer[[7, 8]])
    finally:
        cons.shutdown()
        prod.shutdown()
        if prod2 is not None:
            prod2.shutdown()


def test_transfers_chunked_like_cuda_staging_land_exactly():
    """CUDA pools move pages through a staging ring in chunks; the same ring on CPU pools
    (3 pages a chunk, two slots) must land every byte, the frame riding only the first chunk."""
    staged = StagingShape(chunk_bytes=3 * PAGE, slots=2, stage_host_pools=True)
    src_pool, dst_pool = PagePool(40, PAGE), PagePool(40, PAGE)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(12))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", staging=staged), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path="tcp", num_tcp_streams=1,
                                   staging=staged), dst_pool)
    cons.start()
    try:
        for n in (1, 3, 4, 10):
            src, dst = list(range(1, 1 + n)), list(range(39, 39 - n, -1))
            prod.add_lease(f"r{n}", src)
            job = cons.load(f"r{n}", RemoteAddr("P", "127.0.0.1", prod.port), f"r{n}", src, dst)
            assert job.done.wait(10) and job.result.ok, job.result
            assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("corrupt", [False, True])
def test_pages_arriving_in_pieces_are_checked_piece_by_piece(corrupt):
    pool = PagePool(8, PAGE)
    fake = FakeProducer()
    stream = _open_stream(fake, pool)
    try:
        pages = [bytes(random.Random(i).randbytes(PAGE)) for i in range(3)]
        part, ended = _submit(stream, [1, 2, 3], [5, 6, 7])
        _, msg = framing.recv_frame(fake.conn)
        data = wire.pages_frame(msg["xfer"], [digest(p) for p in pages], PAGE) + b"".join(pages)
        if corrupt:  # one byte in the middle of the second page
            at = wire.pages_frame_size(3) + PAGE + PAGE // 2
            data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
        for i in range(0, len(data), 1000):  # the header and every page in several pieces
            fake.conn.sendall(data[i : i + 1000])
            time.sleep(0.002)
        assert ended.wait(5)
        assert part.bad_block_ids == ([6] if corrupt else [])
        assert part.cause is (FailureCause.CHECKSUM if corrupt else None)
        assert bytes(pool.buffer[5].numpy()) == pages[0] and not stream.dead
    finally:
        stream.close()
        stream.join(5)
        fake.close()


def test_load_checks_block_ids_before_anything_goes_out():
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c"), PagePool(8, PAGE))
    remote = RemoteAddr("P", "127.0.0.1", 1)
    for src, dst in (([-1], [2]), ([2**64], [2]), ([1.0], [2]), ([1], [8]), ([1], [0]), ([1, 2], [3, 3]),
                     ([1, -2], [3, 4]), ([1], [2, 3]), ([], [])):
        with pytest.raises(ValueError):
            cons.load("r", remote, "r", src, dst)
    assert not cons._active


@pytest.mark.parametrize("spin_us", [0, 200, 50_000], ids=["sleep", "default-spin", "long-spin"])
def test_pulls_land_exact_whether_the_stream_thread_spins_or_sleeps(spin_us):
    """`spin_us` only changes how the stream thread waits for an answer, never what lands;
    one-page and many-page pulls, several in a row on the same streams."""
    src_pool, dst_pool = PagePool(40, PAGE), PagePool(40, PAGE)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(5))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c"), src_pool)
    prod.start()
    remote = RemoteAddr("P", "127.0.0.1", prod.port)
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path="tcp", spin_us=spin_us),
                    dst_pool)
    cons.start()
    try:
        for k, (src, dst) in enumerate([([1], [20]), (list(range(2, 18)), list(range(21, 37))), ([3], [38])]):
            prod.add_lease(f"r{k}", src)
            job = cons.load(f"r{k}", remote, f"r{k}", src, dst)
            assert job.done.wait(10) and job.result.ok, job.result
            for s, d in zip(src, dst):
                assert torch.equal(dst_pool.page(d), src_pool.page(s))
    finally:
        cons.shutdown()
        prod.shutdown()


def test_spin_us_is_validated():
    with pytest.raises(ValueError, match="spin_us"):
        ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", spin_us=-1)
