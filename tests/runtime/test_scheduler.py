"""FairScheduler over hand-made shapes: batching, one chunk in flight per stream, and the fair
order (longest-waiting stream first) with its bound on how long a ready stream waits."""

from __future__ import annotations

import math
import random

from runtime.requests import ChunkRequest
from runtime.scheduler import ChunkShape, FairScheduler

SHAPES = {
    "a": ChunkShape("m", 3),
    "b": ChunkShape("m", 3),
    "c": ChunkShape("m", 1),  # another chunk length cannot share a batch
    "d": ChunkShape("other", 3),
}


def make(max_batch: int = 4) -> FairScheduler:
    return FairScheduler(SHAPES.__getitem__, max_batch=max_batch)


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
    assert order == ["a", "b"] * 3


def test_abort_removes_queued_but_not_running():
    s = make()
    s.add_request(req("a", 1))
    s.add_request(req("a", 2))
    plan = s.schedule()
    removed = s.abort_requests({1, 2})
    assert [r.request_id for r in removed] == [2]  # 1 is running; the runner cancels it
    s.update_from_output(plan)
    assert s.queued("a") == 0 and not s.has_unfinished()


def test_a_stream_whose_queue_is_aborted_leaves_the_line():
    s = make()
    s.add_request(req("a", 1))
    s.add_request(req("b", 2))
    assert [r.request_id for r in s.abort_requests({1})] == [1]
    assert [c.stream_id for c in s.schedule().chunks] == ["b"]
    assert not s.has_unfinished()


def test_finished_streams_are_reported_once():
    s = make()
    s.add_request(req("a", 1))
    dropped = s.finish_stream("a")
    assert [r.request_id for r in dropped] == [1]
    plan = s.schedule()
    assert plan.finished_stream_ids == ["a"] and not plan.chunks
    assert s.schedule().is_empty


def test_queue_wait_is_stamped_once_and_a_requeued_chunk_goes_first():
    s = make(max_batch=1)
    a, b = ChunkRequest("a", 1, submitted_at=1.0), ChunkRequest("b", 2, submitted_at=1.0)
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    (first,) = plan.chunks
    assert first.request is a and first.waited_s is not None and first.waited_s > 0
    s.update_from_output(plan)
    s.requeue(a)  # ran on top of a chunk that rolled back: runs again before b, waited once
    again = s.schedule()
    assert [c.request for c in again.chunks] == [a] and again.chunks[0].waited_s is None
    s.update_from_output(again)
    assert [c.request for c in s.schedule().chunks] == [b]


# -- fairness under overload -----------------------------------------------------------------


class Load:
    """Many streams driving a scheduler step by step, as clients would: a lockstep stream
    submits its next request `think` steps after its chunk finished (0: at once, random up to
    `think` otherwise); a realtime stream keeps `ahead` requests queued. Records each stream's
    chunks and, each time a stream became ready, when (step, and a join counter that orders
    streams joining in the same step), how long the line of ready streams was then, and how many
    `schedule()` calls it took to be served."""

    def __init__(
        self, s: FairScheduler, lockstep: list[str], realtime: list[str], ahead: int = 2, seed: int = 0
    ) -> None:
        self.s = s
        self.rng = random.Random(seed)
        self.realtime = set(realtime)
        self.ids = iter(range(1, 10**9))
        self.joins = iter(range(10**9))
        self.chunks = {sid: 0 for sid in lockstep + realtime}
        self.due: dict[str, int] = {}  # lockstep stream -> step at which it submits again
        self.ready_since: dict[str, tuple[int, int, int]] = {}  # stream -> (step, join, line length)
        self.waits: list[tuple[int, int]] = []  # (schedule calls waited, line length at joining)
        self.step = 0
        for sid in lockstep:
            self.submit(sid)
        for sid in realtime:
            for _ in range(ahead):
                self.submit(sid)

    def submit(self, sid: str) -> None:
        # between steps no chunk is running: a stream with a queued request is ready
        self.s.add_request(ChunkRequest(sid, next(self.ids)))
        if sid not in self.ready_since:
            self.ready_since[sid] = (self.step, next(self.joins), len(self.ready_since) + 1)

    def run(self, steps: int, think: int = 0) -> list:
        plans = []
        for _ in range(steps):
            self.step += 1
            for sid, at in sorted(self.due.items()):
                if at <= self.step:
                    del self.due[sid]
                    self.submit(sid)
            plan = self.s.schedule()
            plans.append(plan)
            for sc in plan.chunks:
                since, _, line = self.ready_since.pop(sc.stream_id)
                self.waits.append((self.step - since, line))
            self.s.update_from_output(plan)
            for sc in plan.chunks:
                sid = sc.stream_id
                self.chunks[sid] += 1
                if self.s.queued(sid):  # a realtime stream's second request: ready again at once
                    self.ready_since[sid] = (self.step, next(self.joins), len(self.ready_since) + 1)
                if sid in self.realtime:
                    self.submit(sid)
                elif think:
                    self.due[sid] = self.step + 1 + self.rng.randrange(think + 1)
                else:
                    self.submit(sid)
        return plans


def streams(n: int, prefix: str = "s") -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(n)]


def one_shape(sid: str) -> ChunkShape:
    return ChunkShape("m", 3)


def test_64_lockstep_streams_get_equal_chunks_and_a_bounded_wait():
    s = FairScheduler(one_shape, max_batch=4)
    load = Load(s, lockstep=streams(64), realtime=[])
    for rounds in range(1, 21):
        load.run(64 // 4)
        assert set(load.chunks.values()) == {rounds}  # after each whole round: the same count
    assert max(w for w, _ in load.waits) <= math.ceil(64 / 4)
    assert all(w <= math.ceil(line / 4) for w, line in load.waits)  # never behind a later joiner


def test_the_wait_stays_bounded_while_clients_think_for_random_times():
    s = FairScheduler(one_shape, max_batch=4)
    load = Load(s, lockstep=streams(40), realtime=[], seed=1)
    load.run(300, think=3)
    assert len(load.waits) > 1000
    assert all(w <= math.ceil(line / 4) <= math.ceil(40 / 4) for w, line in load.waits)


def test_realtime_and_lockstep_streams_take_turns_alike():
    s = FairScheduler(one_shape, max_batch=3)
    load = Load(s, lockstep=streams(9, "l"), realtime=streams(6, "r"), ahead=2)
    for rounds in range(1, 6):
        load.run(15 // 3)  # a whole round: 15 streams, 3 a step
        # two queued requests buy a realtime stream no extra turn
        assert set(load.chunks.values()) == {rounds}
    assert max(w for w, _ in load.waits) <= math.ceil(15 / 3)


def test_with_several_worlds_the_longest_waiting_stream_picks_the_batch():
    names = streams(30)
    shapes = {sid: ChunkShape("m" if i % 3 else "other", 3) for i, sid in enumerate(names)}
    s = FairScheduler(shapes.__getitem__, max_batch=4)
    load = Load(s, lockstep=names, realtime=[])
    for _ in range(300):
        waiting = dict(load.ready_since)
        (plan,) = load.run(1)
        oldest = min(waiting, key=lambda sid: waiting[sid][:2])
        served = [c.stream_id for c in plan.chunks]
        assert oldest in served and plan.model_id == shapes[oldest].model_id
        # the rest of the batch: the longest-waiting streams of that world
        same = sorted((w[:2], sid) for sid, w in waiting.items() if shapes[sid] == shapes[oldest])
        assert served == [sid for _, sid in same[: len(served)]]
        assert len(served) == min(4, len(same))
    assert max(w for w, _ in load.waits) <= 30  # one step serves the head: at most N steps
    # a world with fewer streams fills its batches from further back in the line, so its
    # streams get somewhat more turns, within the 1.5x
    assert max(load.chunks.values()) / min(load.chunks.values()) <= 1.5
