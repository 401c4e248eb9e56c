"""web/outbox.py: the bounded outbound queue and its drop policies, without a socket or a loop."""

import pytest

from web.outbox import Item, Outbox, OutboxOverflow


def drain(box: Outbox) -> list[Item]:
    out = []
    while (item := box.pop()) is not None:
        out.append(item)
    return out


def test_control_and_frames_keep_their_order() -> None:
    woken = []
    box = Outbox(max_chunks=2, on_ready=lambda: woken.append(1))
    box.put_control(b"ready")
    box.put_frames(b"f1", 4, True)
    box.put_control(b"pong")
    assert [i.data for i in drain(box)] == [b"ready", b"f1", b"pong"]
    assert len(woken) == 3 and box.dropped == 0


@pytest.mark.parametrize("codec", ["jpeg", "raw"])
def test_intra_codecs_drop_the_oldest_chunk(codec: str) -> None:
    box = Outbox(max_chunks=2)
    box.codec = codec  # type: ignore[assignment]
    box.put_frames(b"f1", 4, True)
    box.put_control(b"cancelled")
    box.put_frames(b"f2", 4, True)
    box.put_frames(b"f3", 3, True)  # full: f1 goes
    assert [i.data for i in drain(box)] == [b"cancelled", b"f2", b"f3"]
    assert box.dropped == 4


def test_h264_drops_until_a_keyframe_and_asks_for_one() -> None:
    asked = []
    box = Outbox(max_chunks=2, on_drop=lambda: asked.append(1))
    box.codec = "h264"
    box.put_frames(b"k1", 4, True)
    box.put_frames(b"p2", 4, False)
    box.put_control(b"error")
    box.put_frames(b"p3", 4, False)  # full: everything queued depends on p2..., all of it goes
    assert asked == [1] and box.dropped == 12
    box.put_frames(b"p4", 4, False)  # still no keyframe: dropped
    assert box.dropped == 16
    box.put_frames(b"k5", 4, True)  # the forced keyframe
    box.put_frames(b"p6", 4, False)
    assert [i.data for i in drain(box)] == [b"error", b"k5", b"p6"]
    assert asked == [1]


def test_h264_keyframe_into_a_full_queue_replaces_it() -> None:
    asked = []
    box = Outbox(max_chunks=1, on_drop=lambda: asked.append(1))
    box.codec = "h264"
    box.put_frames(b"k1", 4, True)
    box.put_frames(b"k2", 4, True)
    assert [i.data for i in drain(box)] == [b"k2"] and asked == [] and box.dropped == 4


def test_too_many_control_messages_overflow() -> None:
    box = Outbox(max_control=2)
    box.put_control(b"a")
    box.put_control(b"b")
    with pytest.raises(OutboxOverflow):
        box.put_control(b"c")


def test_close_goes_last_and_nothing_follows() -> None:
    box = Outbox()
    box.put_control(b"closed")
    box.put_close(1000, "closed")
    box.put_control(b"late")
    box.put_frames(b"late", 1, True)
    items = drain(box)
    assert [i.data for i in items] == [b"closed", b""] and items[1].close == (1000, "closed")


@pytest.mark.parametrize("codec", ["jpeg", "h264"])
def test_lossless_keeps_every_chunk_and_reports_each_pop(codec: str) -> None:
    popped = []
    box = Outbox(max_chunks=2, on_pop=lambda: popped.append(1))
    box.codec = codec  # type: ignore[assignment]
    box.lossless = True  # a one-shot: its producer waits for room instead
    for i in range(5):
        box.put_frames(b"f%d" % i, 4, i == 0)
    assert box.chunks == 5
    assert [i.data for i in drain(box)] == [b"f0", b"f1", b"f2", b"f3", b"f4"]
    assert box.dropped == 0 and len(popped) == 5 and box.chunks == 0
