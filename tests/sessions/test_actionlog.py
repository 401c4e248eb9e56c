"""sessions/actionlog.py: bounded, oldest dropped first (and counted), cut by a rewind."""

from __future__ import annotations

import pytest

from models.actions import FrameAction
from sessions.actionlog import ActionLog

A = [FrameAction(frozenset({"w"}))]


def test_the_log_keeps_the_newest_chunks_and_counts_the_dropped_ones():
    log = ActionLog(limit=3)
    for chunk in range(1, 6):
        log.append(chunk, A)
    assert [c.chunk for c in log.chunks] == [3, 4, 5] and log.dropped == 2
    log.truncate(3)
    assert [c.chunk for c in log.chunks] == [3]
    log.restart()
    assert len(log) == 0 and log.dropped == 0


def test_a_log_keeps_at_least_one_chunk():
    with pytest.raises(ValueError):
        ActionLog(limit=0)
