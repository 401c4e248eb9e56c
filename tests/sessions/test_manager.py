"""sessions/manager.py: what counts against `max_sessions` (detached sessions give way to new ones)."""

from __future__ import annotations

import asyncio

import pytest

from sessions.errors import SessionBusy, SessionNotFound
from sessions.events import ClosedEvent
from sessions.manager import OpenParams
from sessions.session import SessionStatus
from tests.sessions.conftest import Inbox, running


def test_open_at_the_limit_evicts_the_longest_detached_session(worlds):
    async def main():
        async with running(worlds, max_sessions=2) as m:
            a, b = await m.open(OpenParams()), await m.open(OpenParams())
            inbox = Inbox()
            a.activate(inbox)
            b.activate(Inbox())
            with pytest.raises(SessionBusy):  # both attached: really full
                await m.open(OpenParams())
            a.detach()
            b.detach()
            b.detached_at = a.detached_at + 1  # a has waited longer
            c = await m.open(OpenParams())
            assert a.status is SessionStatus.EXPIRED and b.status is SessionStatus.DETACHED
            with pytest.raises(SessionNotFound):
                m.by_token(a.resume_token)
            assert m.by_token(b.resume_token) is b
            c.activate(Inbox())
            await m.open(OpenParams())  # evicts b
            assert b.status is SessionStatus.EXPIRED and len(m) == 2
            with pytest.raises(SessionBusy):
                await m.open(OpenParams())
            assert not inbox.of(ClosedEvent)  # a was detached: nobody was told

    asyncio.run(main())
