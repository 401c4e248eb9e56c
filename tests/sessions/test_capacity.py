"""Realtime admission (sessions/capacity.py): a realtime `open` gets `busy` once the measured
chunk rate cannot give every admitted realtime session its fps; lockstep opens never do."""

from __future__ import annotations

import asyncio

import pytest

from sessions import capacity
from sessions.errors import SessionBusy
from sessions.manager import OpenParams
from tests.sessions.conftest import running


def test_the_rule_admits_while_the_realtime_share_fits():
    rates = {"w": 10.0, "v": 20.0}
    assert capacity.refusal(0.0, {"w": 10.0}, rates, "w") is None  # exactly the measured rate
    assert "110%" in capacity.refusal(0.0, {"w": 11.0}, rates, "w")
    assert capacity.refusal(0.2, {"w": 8.0}, rates, "w") is None
    assert capacity.refusal(0.2, {"w": 8.5}, rates, "w") is not None  # 85% > 80%
    # one device: the worlds' shares add up (6/10 + 10/20 = 110%)
    assert capacity.refusal(0.0, {"w": 6.0, "v": 10.0}, rates, "v") is not None
    assert capacity.refusal(None, {"w": 100.0}, rates, "w") is None  # off
    # before a world's rate is measured its sessions are admitted and claim nothing
    assert capacity.refusal(0.0, {"w": 100.0, "u": 1.0}, {**rates, "u": None}, "u") is None
    assert capacity.refusal(0.0, {"w": 5.0, "u": 100.0}, {**rates, "u": None}, "w") is None


def test_headroom_is_a_fraction():
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError):
            capacity.check_headroom(bad)
    assert capacity.check_headroom(None) is None


def test_a_realtime_open_the_measured_rate_cannot_serve_is_busy(worlds):
    async def main():
        async with running(worlds, realtime_headroom=0.0) as m:
            need = capacity.chunks_per_s(worlds["tiny"].spec)
            meter = m.engine.engine.throughput
            for _ in range(2):  # the first batch is warm-up; then room for 1.5 sessions
                meter.record("tiny", 1, 1 / (1.5 * need))
            # (sessions are not activated: no chunk runs, so the measured rate stays as set)
            first = await m.open(OpenParams(model="tiny"))
            with pytest.raises(SessionBusy, match="capacity"):
                await m.open(OpenParams(model="tiny"))
            await m.open(OpenParams(model="tiny", mode="lockstep"))  # paced by its client
            await m.open(OpenParams(model="tiny-image"))  # not measured yet: admitted
            first.detach()  # a detached session generates nothing
            second = await m.open(OpenParams(model="tiny"))
            await m.close(second)
            assert len(m) == 3

    asyncio.run(main())


def test_without_the_rule_realtime_opens_are_only_limited_by_sessions(worlds):
    async def main():
        async with running(worlds) as m:
            meter = m.engine.engine.throughput
            for _ in range(2):
                meter.record("tiny", 1, 10.0)  # 0.1 chunks/s: far too slow for one session
            for _ in range(3):
                await m.open(OpenParams(model="tiny"))

    asyncio.run(main())


def test_a_lone_realtime_session_is_admitted_on_a_slow_device(worlds):
    """Refusing the only realtime session would leave the device idle: it plays below its fps."""

    async def main():
        async with running(worlds, realtime_headroom=0.0) as m:
            meter = m.engine.engine.throughput
            for _ in range(2):
                meter.record("tiny", 1, 10.0)  # 0.1 chunks/s: far too slow for one session
            first = await m.open(OpenParams(model="tiny"))
            with pytest.raises(SessionBusy, match="capacity"):
                await m.open(OpenParams(model="tiny"))
            await m.close(first)
            await m.open(OpenParams(model="tiny"))  # alone again

    asyncio.run(main())
