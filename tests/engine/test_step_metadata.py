"""The step's inputs (pd/engine/attention/metadata.py): built once a step into buffers whose
addresses never change, with the positions, slots, tables and offsets the chunks say."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.engine.attention.metadata import StepCapacity, StepInputBuilder
from pd.engine.kv.layout import KVLayout
from pd.engine.model.config import ModelConfig
from pd.engine.sched.output import ScheduledChunk

HYBRID = ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"),
                     sliding_window=12)
BS = 4


@st.composite
def steps(draw):
    """A step of chunks (decode tokens and prompt chunks), each with a block table per group that
    covers its tokens (distinct block ids, none the null block 0)."""
    num = draw(st.integers(1, 6))
    chunks, next_block = [], 1
    for i in range(num):
        start = draw(st.integers(0, 40))
        n = draw(st.sampled_from([1, 1, draw(st.integers(1, 20))]))
        need = (start + n + BS - 1) // BS + draw(st.integers(0, 2))
        tables = []
        for _ in range(2):
            tables.append(list(range(next_block, next_block + need)))
            next_block += need
        ids = draw(st.lists(st.integers(0, 255), min_size=n, max_size=n))
        chunks.append(ScheduledChunk(f"r{i}", ids, start, tuple(tables), draw(st.booleans())))
    return chunks


def _pointers(builder):
    h = builder._host
    return [h.per_token.data_ptr(), h.per_seq.data_ptr()] + [t.data_ptr() for t in h.block_tables]


@settings(max_examples=80, deadline=None)
@given(step_chunks=st.lists(steps(), min_size=1, max_size=3), fixed=st.booleans())
def test_every_field_is_what_the_chunks_say_and_the_buffers_stay_put(step_chunks, fixed):
    layout = KVLayout(HYBRID, BS)
    builder = StepInputBuilder(layout, "cpu", StepCapacity(200, 8, 32), fixed_table_width=fixed)
    pointers = _pointers(builder)
    for chunks in step_chunks:
        m = builder.build(chunks)
        assert _pointers(builder) == pointers  # the same memory every step
        assert m.host is m and m.num_seqs == len(chunks)
        ids = [t for c in chunks for t in c.token_ids]
        positions = [c.start + j for c in chunks for j in range(len(c.token_ids))]
        seq = [i for i, c in enumerate(chunks) for _ in c.token_ids]
        assert m.num_tokens == len(ids) and m.input_ids.tolist() == ids
        assert m.positions.tolist() == positions and m.token_seq.tolist() == seq
        assert m.slot_offsets.tolist() == [p % BS for p in positions]
        for g in range(len(layout.groups)):
            blocks = [chunks[i].block_ids[g][p // BS] for i, p in zip(seq, positions, strict=True)]
            assert m.slot_blocks[g].tolist() == blocks
            assert m.slot_mapping[g].tolist() == [b * BS + p % BS for b, p in zip(blocks, positions, strict=True)]
            table = m.block_tables[g]
            assert table.is_contiguous() and table.shape[0] == len(chunks)
            assert table.shape[1] == (32 if fixed else max(len(c.block_ids[g]) for c in chunks))
            for row, c in zip(table.tolist(), chunks, strict=True):
                assert row == c.block_ids[g] + [0] * (table.shape[1] - len(c.block_ids[g]))
        ends = [c.start + len(c.token_ids) for c in chunks]
        assert m.seq_lens.tolist() == ends
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.token_ids))
        assert m.query_start_loc.tolist() == starts
        assert m.logits_indices.tolist() == [starts[i + 1] - 1 for i, c in enumerate(chunks) if c.needs_logits]
        assert m.decode_only == all(len(c.token_ids) == 1 for c in chunks)


def test_a_token_past_its_block_table_is_refused_before_anything_is_written():
    layout = KVLayout(ModelConfig(num_layers=2), BS)
    builder = StepInputBuilder(layout, "cpu")
    with pytest.raises(ValueError, match="null block"):
        builder.build([ScheduledChunk("a", [1, 2, 3], 3, ([7],), True)])  # position 4 needs a second block
    with pytest.raises(ValueError, match="null block"):
        builder.build([ScheduledChunk("a", [1], 0, ([0],), True)])  # the null block itself


def test_a_step_larger_than_the_buffers_grows_them():
    """An engine sizes the buffers from its config, so this never happens there; a runner used alone
    still gets a correct step."""
    layout = KVLayout(ModelConfig(num_layers=2), BS)
    builder = StepInputBuilder(layout, "cpu", StepCapacity(4, 2, 2))
    chunk = ScheduledChunk("a", list(range(9)), 0, (list(range(1, 4)),), True)
    m = builder.build([chunk])
    assert m.positions.tolist() == list(range(9)) and builder.capacity == StepCapacity(9, 2, 3)


def test_a_decode_step_pads_to_a_bucket_with_harmless_rows():
    """Padding rows (a graph's bucket) write to the null block's slot 0 and attend to nothing; the
    real rows and their logits indices are as without padding, and the addresses stay put."""
    layout = KVLayout(HYBRID, BS)
    builder = StepInputBuilder(layout, "cpu", StepCapacity(16, 8, 8), fixed_table_width=True)
    chunks = [ScheduledChunk("a", [7], 9, ([1, 2, 3], [4, 5, 6]), True), ScheduledChunk("b", [8], 2, ([9], [10]), True)]
    plain = builder.build(chunks)
    want = {name: getattr(plain, name).clone() for name in ("input_ids", "positions", "slot_mapping", "seq_lens")}
    tables = [t.clone() for t in plain.block_tables]
    pointer = plain.positions.data_ptr()
    m = builder.build(chunks, pad_to=5)
    assert (m.num_tokens, m.num_seqs, m.num_padded) == (5, 5, 3) and m.positions.data_ptr() == pointer
    assert m.logits_indices.tolist() == [0, 1] and m.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    for name, value in want.items():
        assert torch.equal(getattr(m, name)[..., :2], value), name
    assert m.input_ids[2:].tolist() == [0] * 3 and m.positions[2:].tolist() == [0] * 3
    assert m.slot_mapping[:, 2:].tolist() == [[0] * 3] * 2 and m.seq_lens[2:].tolist() == [0] * 3
    for table, before in zip(m.block_tables, tables, strict=True):
        assert torch.equal(table[:2], before) and not table[2:].any()
    with pytest.raises(ValueError, match="only a step of decode tokens pads"):
        builder.build([ScheduledChunk("c", [1, 2], 0, ([1], [2]), True)], pad_to=4)
    with pytest.raises(ValueError, match="only a step of decode tokens pads"):
        builder.build(chunks, pad_to=1)


@pytest.mark.gpu
def test_on_a_gpu_the_device_buffers_mirror_the_host_and_stay_put():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layout = KVLayout(HYBRID, BS)
    builder = StepInputBuilder(layout, "cuda", StepCapacity(64, 8, 16))
    chunks = [ScheduledChunk("a", [1, 2, 3], 5, ([1, 2], [3, 4]), True),
              ScheduledChunk("b", [4], 9, ([5, 6, 7], [8, 9, 10]), True)]
    first = builder.build(chunks)
    ptr = first.positions.data_ptr()
    second = builder.build(chunks[::-1])
    assert second.positions.data_ptr() == ptr and second.positions.is_cuda
    names = ("input_ids", "positions", "slot_mapping", "token_seq", "seq_lens", "query_start_loc", "logits_indices")
    for name in names:
        assert torch.equal(getattr(second, name).cpu(), getattr(second.host, name)), name
    for table, host in zip(second.block_tables, second.host.block_tables, strict=True):
        assert torch.equal(table.cpu(), host)
