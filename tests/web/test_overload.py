"""Realtime admission over the websocket and queue wait on /metrics (issue 39, item 2)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed

from sessions import capacity
from web import messages as m
from web.cli import _parser

from .conftest import dial, recv, run, send, serving


async def metrics_text(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            return r.read().decode()

    return await asyncio.to_thread(get)


class FixedRate:
    """A throughput meter that reports a set rate whatever the engine measures."""

    def __init__(self, rate: float) -> None:
        self.fixed = rate

    def record(self, model_id: str, batch: int, seconds: float) -> float:
        return self.fixed

    def rate(self, model_id: str) -> float:
        return self.fixed


def test_a_realtime_open_past_the_measured_rate_gets_busy_and_lockstep_still_opens(worlds):
    async def main():
        async with serving(worlds, realtime_headroom=0.0) as server:
            need = capacity.chunks_per_s(worlds["tiny"].spec)
            server.runtime.engine_thread.engine.throughput = FixedRate(1.5 * need)
            first = await dial(server)
            await send(first, m.Open(seed=1, codec="raw"))
            assert isinstance(await recv(first), m.Ready)

            refused = await dial(server)
            await send(refused, m.Open(seed=2, codec="raw"))
            err = await recv(refused)
            assert isinstance(err, m.Error) and err.code == "busy" and err.fatal, err
            assert "capacity" in err.message
            with pytest.raises(ConnectionClosed):
                while True:
                    await recv(refused, 30)
            assert refused.close_code == 1013

            lockstep = await dial(server)
            await send(lockstep, m.Open(seed=3, mode="lockstep", codec="raw"))
            assert isinstance(await recv(lockstep), m.Ready)
            await send(lockstep, m.Step(seq=1, actions=[{}]))
            while not isinstance(await recv(lockstep), m.Frames):
                pass

            text = await metrics_text(server.url)
            assert 'worldserve_queue_wait_seconds_count{mode="lockstep",model="tiny"}' in text
            assert 'worldserve_queue_wait_seconds_bucket{le="64.0",mode="realtime",model="tiny"}' in text
            assert "worldserve_queued_chunks" in text
            for ws in (first, lockstep):
                await ws.close()

    run(main())


def test_the_serve_flag_sets_or_turns_off_the_headroom():
    parse = _parser().parse_args
    assert parse(["serve"]).realtime_headroom == 0.0  # on by default for `worldserve serve`
    assert parse(["serve", "--realtime-headroom", "0.25"]).realtime_headroom == 0.25
    assert parse(["serve", "--realtime-headroom", "off"]).realtime_headroom is None
    for bad in ("1", "-0.5", "lots"):
        with pytest.raises(SystemExit):
            parse(["serve", "--realtime-headroom", bad])
