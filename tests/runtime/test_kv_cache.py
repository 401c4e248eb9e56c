"""Slot arithmetic of the KV ring and cache admission."""

from __future__ import annotations

import numpy as np
import pytest

from models.kv_pool import KVPool
from runtime.kv_cache import KVLayout


def valid_slots(lay: KVLayout, committed: int, n_new: int) -> list[int]:
    return np.flatnonzero(lay.valid_frames(committed, n_new)).tolist()


def test_slots_fill_in_order_then_wrap_keeping_sinks():
    lay = KVLayout(sink_frames=1, window_frames=4, tokens_per_frame=2)
    assert [lay.slot_of(f) for f in range(9)] == [0, 1, 2, 3, 4, 1, 2, 3, 4]
    assert lay.write_slots(0, 2).tolist() == [0, 1, 2, 3] and valid_slots(lay, 0, 2) == [0, 1]
    assert lay.write_slots(4, 2).tolist() == [8, 9, 2, 3] and valid_slots(lay, 4, 2) == [0, 1, 2, 3, 4]


def test_index_pads_the_bucket_with_the_pad_row():
    lay = KVLayout(sink_frames=1, window_frames=4, tokens_per_frame=2)
    idx = lay.index([3, None, 0], [4, 6, 0], 2, pad_row=7, bucket=4)  # None: a cancelled entry
    assert idx.rows.tolist() == [3, 7, 0, 7]
    assert idx.valid.tolist() == [[True] * 5] + [[True, True, False, False, False]] * 3
    assert idx.frame_offset.tolist() == [4, 0, 0, 0]
    assert idx.write.tolist() == [[8, 9, 2, 3]] + [[0, 1, 2, 3]] * 3
    with pytest.raises(ValueError, match="bucket"):
        lay.index([0, 1], [0, 0], 2, pad_row=7, bucket=1)


@pytest.mark.parametrize(("sinks", "window", "chunk"), [(0, 4, 2), (1, 5, 2), (2, 6, 3), (0, 3, 3)])
@pytest.mark.parametrize("slack", [0, 1])
def test_attended_frames_live_in_valid_slots_and_scratch_never_hits_them(sinks, window, chunk, slack):
    lay = KVLayout(sinks, window, 1, slack * chunk)
    committed = 0
    for _ in range(12):
        valid = set(valid_slots(lay, committed, chunk))
        attended = lay.attended(committed, chunk)
        slots = {lay.slot_of(f) for f in attended}
        writes = set(lay.write_slots(committed, chunk).tolist())
        assert len(slots) == len(attended)  # no two attended frames share a slot
        assert not slots & writes  # scratch never hits reads
        assert valid == slots | writes  # the mask holds exactly attended + scratch
        committed += chunk


@pytest.mark.parametrize(("sinks", "window", "chunk"), [(0, 4, 2), (1, 5, 2), (2, 6, 3), (1, 7, 3)])
def test_with_slack_a_second_chunk_in_flight_never_overwrites_what_a_retry_reads(sinks, window, chunk):
    """Pipelined decode: chunk k+1 writes on top of uncommitted chunk k. If k rolls back, its
    retry reads the same frames k read, so k+1's writes must miss all of them."""
    lay = KVLayout(sinks, window, 1, slack_frames=chunk)
    for committed in range(0, 40, chunk):
        k_reads = {lay.slot_of(f) for f in lay.attended(committed, chunk)}
        successor_writes = set(lay.write_slots(committed + chunk, chunk).tolist())
        assert not k_reads & successor_writes
    bare = KVLayout(sinks, window, 1)  # without slack the ring is too small for that once it wraps
    late = 10 * chunk
    reads = {bare.slot_of(f) for f in bare.attended(late, chunk)}
    assert reads & set(bare.write_slots(late + chunk, chunk).tolist())


def test_attended_window_contents():
    lay = KVLayout(sink_frames=2, window_frames=4, tokens_per_frame=1)
    assert lay.attended(0, 2) == []
    assert lay.attended(3, 2) == [0, 1, 2]
    assert lay.attended(10, 2) == [0, 1, 8, 9]


def test_committed_view_is_frame_ordered():
    lay = KVLayout(sink_frames=0, window_frames=3, tokens_per_frame=1)
    pool = KVPool(rows=2, layers=1, capacity=3, heads=1, head_dim=1, text_tokens=1)
    for f in range(5):  # write frame index as the value, in row 1
        pool.k[0, 1, lay.slot_of(f)] = float(f)
    view = lay.committed_view(pool, 1, committed=5, n_next=1)
    assert view["k"][0, :, 0, 0].tolist() == [3.0, 4.0]


def test_chunk_larger_than_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        KVLayout(0, 2, 1).write_slots(0, 3)


@pytest.mark.parametrize("slack", [0, 3])
def test_recache_rewrites_every_frame_within_the_span_then_the_window_only(slack):
    lay = KVLayout(sink_frames=3, window_frames=9, tokens_per_frame=2, slack_frames=slack)
    assert lay.recache_frames(6) == range(0, 6)  # all 6 cached frames, the sinks among them
    assert lay.recache_frames(12) == range(0, 12)  # the span exactly: still all of them
    assert lay.recache_frames(15) == range(6, 15)  # beyond: the last 9, the sinks keep theirs
    idx = lay.recache_index(row=1, committed=15)
    frames = [lay.slot_of(f) for f in range(6, 15)]
    assert idx.rows.tolist() == [1] and idx.frame_offset.tolist() == [6]
    assert (idx.write[0, ::2] // 2).tolist() == frames
    assert np.flatnonzero(idx.valid[0].numpy()).tolist() == sorted({0, 1, 2, *frames})
    early = lay.recache_index(row=0, committed=6)
    assert np.flatnonzero(early.valid[0].numpy()).tolist() == list(range(6))


@pytest.mark.parametrize(
    ("sinks", "window", "chunk", "slack"), [(0, 4, 2, 0), (1, 5, 2, 2), (2, 6, 3, 3), (1, 7, 1, 0)]
)
def test_the_batched_index_is_each_entrys_own_slots_and_reads_its_filled_prefix(sinks, window, chunk, slack):
    """`index` is built for all entries at once: each entry's row equals `write_slots` and
    `valid_frames` of its own committed length; its host span ends at its last valid slot and
    says whether a slot inside it must be masked."""
    lay = KVLayout(sinks, window, 2, slack)
    committed = list(range(0, 12 * chunk, chunk))
    rows = list(range(len(committed)))
    idx = lay.index(rows, committed, chunk, pad_row=99)
    for i, done in enumerate(committed):
        valid = lay.valid_frames(done, chunk)
        assert idx.write[i].tolist() == lay.write_slots(done, chunk).tolist()
        assert idx.valid[i].tolist() == valid.tolist()
        span = int(np.flatnonzero(valid)[-1]) + 1
        assert idx.host.spans[i] == span and idx.host.holes[i] == (not valid[:span].all())
        assert idx.host.rows[i] == i
    filling = [i for i, d in enumerate(committed) if d + chunk <= lay.capacity_frames]
    assert all(idx.host.spans[i] == committed[i] + chunk for i in filling)  # only what is filled
    assert any(idx.host.holes) == (slack > 0)  # without slack a wrapped ring is read whole
