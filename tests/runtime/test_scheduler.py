"""FifoScheduler over hand-made shapes: batching, fairness, one chunk in flight per stream."""

from __future__ import annotations

from runtime.requests import ChunkRequest
from runtime.scheduler import ChunkShape, FifoScheduler

SHAPES = {
    "a": ChunkShape("m", 3),
    "b": ChunkShape("m", 3),
    "c": ChunkShape("m", 1),  # another chunk length cannot share a batch
    "d": ChunkShape("other", 3),
}


def make(max_batch: int = 4) -> FifoScheduler:
    return FifoScheduler(SHAPES.__getitem__, max_batch=max_batch)


def req(sid: str, rid: int) -> ChunkRequest:
    return ChunkRequest(sid, rid)


def test_batches_only_compatible_shapes():
    s = make()
    for i, sid in enumerate("abcd"):
        s.add_request(req(sid, i))
    seen = []
    for _ in range(3):
        plan = s.schedule()
        shapes = {SHAPES[c.stream_id] for c in plan.chunks}
        assert len(shapes) == 1 and plan.model_id == next(iter(shapes)).model_id
        seen += [c.stream_id for c in plan.chunks]
        s.update_from_output(plan)
    assert sorted(seen) == ["a", "b", "c", "d"]
    assert not s.has_unfinished()


def test_one_chunk_in_flight_per_stream_and_fifo_order():
    s = make()
    for rid in (1, 2, 3):
        s.add_request(req("a", rid))
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == [1]
    assert s.schedule().chunks == []  # a is running
    s.update_from_output(plan)
    assert [c.request.request_id for c in s.schedule().chunks] == [2]


def test_round_robin_with_small_batches():
    s = make(max_batch=1)
    for sid in "ab":
        for rid in range(3):
            s.add_request(req(sid, rid))
    order = []
    for _ in range(6):
        plan = s.schedule()
        order.append(plan.chunks[0].stream_id)
        s.update_from_output(plan)
    assert order.count("a") == 3 and order[:2] in (["a", "b"], ["b", "a"])


def test_abort_removes_queued_but_not_running():
    s = make()
    s.add_request(req("a", 1))
    s.add_request(req("a", 2))
    plan = s.schedule()
    removed = s.abort_requests({1, 2})
    assert [r.request_id for r in removed] == [2]  # 1 is running; the runner cancels it
    s.update_from_output(plan)
    assert s.queued("a") == 0 and not s.has_unfinished()


def test_finished_streams_are_reported_once():
    s = make()
    s.add_request(req("a", 1))
    dropped = s.finish_stream("a")
    assert [r.request_id for r in dropped] == [1]
    plan = s.schedule()
    assert plan.finished_stream_ids == ["a"] and not plan.chunks
    assert s.schedule().is_empty
