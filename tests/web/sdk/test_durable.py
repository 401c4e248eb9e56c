"""web/sdk/durable: a TCP connection cut in the middle of an episode loses and repeats no step.

The cut lands at each moment that matters, found by watching the relay and the server (no
sleeps): before the server got the step, while it generates the chunk, and after it committed
the chunk but before the client saw it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from tests.web.browser.harness import DropProxy
from web.errors import SessionClosed
from web.sdk.gym_env import WorldEnv

STEPS = 4
CUT_AT = 2  # the step (0-based) whose connection is cut


class HoldingProxy(DropProxy):
    """A :class:`DropProxy` that can also hold the bytes of one direction ("up": client to
    server, "down": server to client) in the relay until :meth:`drop` cuts everything."""

    def __init__(self, target_port: int) -> None:
        self.held = ""  # the direction being held, "" for none
        self.holding = threading.Event()  # set once bytes sit in the relay
        self._flow = threading.Event()
        self._flow.set()
        super().__init__(target_port)

    def hold(self, direction: str) -> None:
        self.held = direction
        self.holding.clear()
        self._flow.clear()

    def drop(self) -> int:
        # Stop holding before the cut: the client reconnects as soon as it sees the cut, and its
        # new connection's bytes (the handshake) must flow. A relay thread blocked on held bytes
        # cannot read more, so nothing of the old connection slips through meanwhile.
        self.held = ""
        cut = super().drop()
        self._flow.set()  # held relay threads wake up on dead sockets and exit
        return cut

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:  # type: ignore[override]
        direction = "down" if src.getpeername()[1] == self.target_port else "up"
        try:
            while data := src.recv(65536):
                if self.held == direction:
                    self.holding.set()
                    self._flow.wait()
                    continue  # cut while held: these bytes never arrive
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def actions() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"keys": rng.integers(0, 2, 5, dtype=np.int8)} for _ in range(STEPS)]


def until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def run_episode(env: WorldEnv) -> list[tuple[int, np.ndarray]]:
    """(chunk, frames) of every step of one undisturbed episode."""
    env.reset(seed=11)
    out = []
    for action in actions():
        info = env.step(action)[4]
        out.append((info["chunk"], env.world.last_chunk.frames))
    return out


@pytest.mark.parametrize("moment", ["before the server got it", "while generating", "after commit"])
def test_cut_connection_mid_episode_loses_and_repeats_no_step(server, moment) -> None:
    debug = {"step_delay_ms": 100.0} if moment == "while generating" else None
    env = WorldEnv(server.url, debug=debug)
    try:
        want = run_episode(env)
    finally:
        env.close()

    proxy = HoldingProxy(server.port)
    env = WorldEnv(proxy.url, debug=debug)
    session = server.manager.get(env.world.durable.ready.session_id)

    def cut() -> None:
        if moment == "while generating":
            until(lambda: session.outstanding > 0, "the step to reach the engine")
        else:
            until(lambda: proxy.holding.is_set(), "the relay to hold the step")
            if moment == "after commit":
                until(lambda: session.last_chunk == CUT_AT + 1, "the chunk to commit")
        proxy.drop()

    try:
        env.reset(seed=11)
        got = []
        for i, action in enumerate(actions()):
            cutter = None
            if i == CUT_AT:
                if moment == "before the server got it":
                    proxy.hold("up")
                elif moment == "after commit":
                    proxy.hold("down")
                cutter = threading.Thread(target=cut)
                cutter.start()
            info = env.step(action)[4]
            if cutter is not None:
                cutter.join()
            got.append((info["chunk"], env.world.last_chunk.frames))
        assert env.world.durable.resumes == 1
        assert session.last_chunk == STEPS  # the server made every chunk once
    finally:
        env.close()
        proxy.close()
    assert [c for c, _ in got] == list(range(1, STEPS + 1))
    for (_, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_gives_up_when_the_server_is_gone(server) -> None:
    proxy = DropProxy(server.port)
    env = WorldEnv(proxy.url)
    env.world.durable.reconnect_tries = 2
    try:
        env.reset(seed=0)
        proxy.close()  # no listener any more: every resume attempt fails
        with pytest.raises(SessionClosed, match="could not resume"):
            env.step({})
    finally:
        env._loop.close()
