"""An engine on `cuda:N` with N > 0 captures, replays and fences its step copies on device N, whichever device
the thread has current (device 0 unless told). CUDA is mocked out: a fake `torch.cuda` records the device
current at each capture, replay and forward, and the device every stream, event and synchronisation is
asked for."""
from __future__ import annotations

import contextlib
import types

import torch

from pd.engine.attention import metadata as metadata_module
from pd.engine.attention.metadata import StepCapacity, StepInputBuilder, _Buffers
from pd.engine.kv.layout import KVLayout
from pd.engine.model.config import ModelConfig
from pd.engine.runner.cuda_graphs import DecodeGraphs

TARGET = torch.device("cuda", 1)


class FakeCuda:
    """The parts of `torch.cuda` the graphs and the step builder touch, recording devices."""

    def __init__(self):
        self.current = 0  # the thread's current device, as CUDA starts
        self.seen: list[tuple[str, object]] = []  # (what, device index asked for or current)

    def _index(self, device) -> int:
        return self.current if device is None else torch.device(device).index

    def install(self, monkeypatch) -> None:
        fake = self

        @contextlib.contextmanager
        def device(dev):
            before, fake.current = fake.current, torch.device(dev).index
            try:
                yield
            finally:
                fake.current = before

        class Stream:
            def __init__(self, dev=None):
                self.index = fake._index(dev)
                fake.seen.append(("stream", self.index))

            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                fake.seen.append(("replay on current", fake.current))

        @contextlib.contextmanager
        def graph(g, pool=None):
            fake.seen.append(("capture on current", fake.current))
            yield

        class Event:
            def record(self, stream=None):
                fake.seen.append(("event", fake.current if stream is None else stream.index))

            def synchronize(self):
                pass

        def current_stream(dev=None):
            return Stream(dev)

        def synchronize(dev=None):
            fake.seen.append(("synchronize", fake._index(dev)))

        def mem_get_info(dev=None):
            fake.seen.append(("mem_get_info", fake._index(dev)))
            return (1 << 30, 1 << 31)

        for name, value in dict(is_available=lambda: True, device=device, Stream=Stream, CUDAGraph=Graph,
                                graph=graph, Event=Event, current_stream=current_stream, synchronize=synchronize,
                                mem_get_info=mem_get_info, graph_pool_handle=lambda: object(),
                                stream=lambda s: contextlib.nullcontext()).items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_graphs_capture_and_replay_on_the_engines_device_not_the_current_one(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    forwards: list[int] = []
    builder = types.SimpleNamespace(device=TARGET, allocations=1, fixed_table_width=True,
                                    capacity=StepCapacity(max_num_seqs=2), build=lambda chunks, pad_to: pad_to)
    graphs = DecodeGraphs(builder, lambda metadata: forwards.append(fake.current) or torch.zeros(metadata),
                          max_num_seqs=2)
    assert graphs.why_not() is None
    report = graphs.capture(warmup_iters=1)
    assert report.sizes == (1, 2)
    graphs.replay(2)
    assert fake.current == 0  # the thread's device is left as it was
    assert forwards and set(forwards) == {1}
    kinds = {what for what, _ in fake.seen}
    assert {"capture on current", "replay on current", "stream", "synchronize", "mem_get_info"} <= kinds
    assert all(index == 1 for _, index in fake.seen), fake.seen


def test_the_step_copies_are_fenced_on_the_engines_device(monkeypatch):
    fake = FakeCuda()
    layout = KVLayout(ModelConfig(num_layers=2), 4)
    builder = StepInputBuilder(layout, "cpu", StepCapacity(16, 4, 8), fixed_table_width=True)
    # the builder as on cuda:1: a device mirror apart from the host one (CPU tensors stand in for it)
    builder._device = _Buffers(builder.capacity, len(layout.groups), torch.device("cpu"))
    builder.device = TARGET
    fake.install(monkeypatch)
    assert metadata_module.torch.cuda.Event is torch.cuda.Event
    builder.build([], pad_to=2)
    builder.build([], pad_to=1)  # waits for the first step's copies, then fences its own
    assert [s for s in fake.seen if s[0] == "event"] == [("event", 1), ("event", 1)]
