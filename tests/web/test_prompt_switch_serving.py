"""`prompt` mid-session against a converted tiny LongLive world served with a tiny UMT5 text
encoder (`serve --text-encoder DIR`): `prompted`, then the next chunk is generated under the new
prompt and its `frames` carry `prompt_seq`; frames before it are those of a session that never
switched; a world without prompts or a prompt over the limit is `invalid_field` and the session
goes on; the SDK's `session.prompt`; a cancelled switch is dropped (`cancelled.prompt_seq`); the
new prompt is encoded on the prompt worker."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from models.text_prompts import EncodedPrompts
from models.world import World
from tests.fixtures.golden.served import write_longlive_dir, write_umt5_dir
from tests.web.conftest import dial, recv, recv_until, run, send, serving
from web import cli
from web import messages as m
from web.sdk import aio

PROMPT, OTHER = "a red car on a beach", "a castle at night"
TOO_LONG = "a long road " * 8  # 25 tokens with its EOS: the tiny world takes 16
IDLE = (m.FrameAction(),)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory, worlds: dict[str, World]) -> dict[str, World]:
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("ll_text")
    enc = tmp / "umt5"
    enc.mkdir()
    model, enc = write_longlive_dir(tmp), write_umt5_dir(enc)
    args = cli._parser().parse_args(
        ["serve", "--model", str(model), "--text-encoder", str(enc), "--device", "cpu"]
    )
    return cli._load(args.model, args) | {"tiny": worlds["tiny"]}


async def _step(ws, seq: int) -> m.Frames:
    await send(ws, m.Step(seq=seq, actions=IDLE))
    got = await recv(ws)
    assert isinstance(got, m.Frames), got
    return got


def test_a_switch_changes_the_chunks_after_it_only(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="longlive") as server:
            plain, switched = await dial(server), await dial(server)
            for ws in (plain, switched):
                await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT))
                await recv_until(ws, m.Ready)
            for seq in (1, 2):
                a, b = await _step(plain, seq), await _step(switched, seq)
                assert np.array_equal(a.data, b.data) and b.prompt_seq is None
            await send(switched, m.PromptSwitch(seq=3, text=OTHER))
            assert await recv(switched) == m.Prompted(seq=3)
            a, b = await _step(plain, 4), await _step(switched, 4)
            assert b.prompt_seq == 3 and a.prompt_seq is None
            assert not np.array_equal(a.data, b.data)
            c = await _step(switched, 5)
            assert c.prompt_seq is None  # only the first chunk under it says so
            for ws in (plain, switched):
                await ws.close()

    run(main())


def test_a_bad_prompt_is_invalid_field_and_the_session_goes_on(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="longlive") as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT))
            await recv_until(ws, m.Ready)
            first = await _step(ws, 1)
            await send(ws, m.PromptSwitch(seq=2, text=TOO_LONG))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and not err.fatal, err
            assert err.seq == 2 and err.message.startswith("text:") and "at most 16" in err.message
            second = await _step(ws, 3)
            assert second.prompt_seq is None and second.chunk == first.chunk + 1
            await ws.close()

            ws = await dial(server)  # a world without prompts
            await send(ws, m.Open(model="tiny", mode="lockstep", codec="raw"))
            await recv_until(ws, m.Ready)
            await send(ws, m.PromptSwitch(seq=1, text=PROMPT))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field", err
            assert "takes no prompt" in err.message
            await _step(ws, 2)
            await ws.close()

    run(main())


def test_a_cancelled_switch_is_dropped(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="longlive", debug_hooks=True) as server:
            ws = await dial(server)
            slow = m.DebugHooks(step_delay_ms=200)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT, debug=slow))
            await recv_until(ws, m.Ready)
            await send(ws, m.PromptSwitch(seq=1, text=OTHER))
            assert await recv(ws) == m.Prompted(seq=1)
            await send(ws, m.Step(seq=2, actions=IDLE))
            await send(ws, m.Cancel(seq=3))
            got = await recv_until(ws, m.Cancelled)
            assert got[-1] == m.Cancelled(seq=3, chunk=1, prompt_seq=1), got
            after = await _step(ws, 4)
            assert after.prompt_seq is None
            await ws.close()
            # the same chunk of a session that never switched
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT, debug=slow))
            await recv_until(ws, m.Ready)
            assert np.array_equal((await _step(ws, 1)).data, after.data)
            await ws.close()

    run(main())


def test_sdk_session_prompt(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="longlive") as server:
            async with aio.connect(server.url, mode="lockstep", codec="raw", seed=3, prompt=PROMPT) as s:
                await s.step({})
                seq = await s.prompt(OTHER)
                switched = await s.step({})
                with pytest.raises(Exception, match="at most 16"):
                    await s.prompt(TOO_LONG)
                forked = await s.fork()
                after = await s.step({})
            async with aio.connect(server.url, mode="lockstep", codec="raw", seed=3, prompt=PROMPT) as s:
                await s.step({})
                assert not np.array_equal(await s.step({}), switched)
            async with aio.connect(server.url, resume=forked, codec="raw") as f:  # the fork has OTHER
                assert np.array_equal(await f.step({}), after)
            assert seq > 0

    run(main())


def test_the_latest_waiting_prompt_wins(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="longlive") as server:
            once, twice = await dial(server), await dial(server)
            for ws in (once, twice):
                await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT))
                await recv_until(ws, m.Ready)
                await _step(ws, 1)
            await send(twice, m.PromptSwitch(seq=2, text="a blue boat"))
            assert await recv(twice) == m.Prompted(seq=2)
            await send(twice, m.PromptSwitch(seq=3, text=OTHER))  # replaces seq 2 before any chunk
            assert await recv(twice) == m.Prompted(seq=3)
            await send(once, m.PromptSwitch(seq=3, text=OTHER))
            assert await recv(once) == m.Prompted(seq=3)
            a, b = await _step(once, 4), await _step(twice, 4)
            assert a.prompt_seq == b.prompt_seq == 3 and np.array_equal(a.data, b.data)
            for ws in (once, twice):
                await ws.close()

    run(main())


def test_sdk_realtime_chunks_say_which_is_the_first_under_a_prompt(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with (
            serving(worlds, default_model="longlive") as server,
            aio.connect(server.url, codec="raw", seed=3, prompt=PROMPT) as s,
        ):
            first = await s.next_chunk()
            assert first is not None and first.prompt_seq is None
            seq = await s.prompt(OTHER)
            seen = []
            while not seen or seen[-1].prompt_seq is None:
                chunk = await s.next_chunk()
                assert chunk is not None
                seen.append(chunk)
            assert seen[-1].prompt_seq == seq and len(seen) <= 3  # at most the chunks queued before it

    run(main())


def test_a_switch_is_encoded_on_the_prompt_worker(worlds: dict[str, World]) -> None:
    source = worlds["longlive"].prompts
    assert isinstance(source, EncodedPrompts)
    threads: list[str] = []
    encode = source.encoder.encode_ids

    def spy(ids: list[int]) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return encode(ids)

    source.encoder.encode_ids = spy  # type: ignore[method-assign]
    try:

        async def main() -> None:
            async with serving(worlds, default_model="longlive") as server:
                ws = await dial(server)
                await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=PROMPT))
                await recv_until(ws, m.Ready)
                await send(ws, m.PromptSwitch(seq=1, text="a red castle"))
                assert await recv(ws) == m.Prompted(seq=1)
                assert (await _step(ws, 2)).prompt_seq == 1
                await ws.close()

        run(main())
    finally:
        del source.encoder.encode_ids
    assert threads and set(threads) == {"worldserve-prompts"}


def test_a_rewind_stops_at_a_prompt_switch(worlds: dict[str, World]) -> None:
    """A switch moves the world to another row under another prompt: chunks before it are not
    retained (`not_retained`, the session intact), the switching chunk itself is, exactly."""
    from web.errors import ServerError

    async def main() -> None:
        async with (
            serving(worlds, default_model="longlive") as server,
            aio.connect(server.url, mode="lockstep", codec="raw", seed=3, prompt=PROMPT) as s,
        ):
            await s.step({})
            await s.step({})
            await s.prompt(OTHER)
            await s.step({})  # chunk 3, the first under OTHER
            want = await s.step({})
            with pytest.raises(ServerError) as err:
                await s.rewind(2)
            assert err.value.code == "not_retained"
            ready = await s.rewind(3)
            assert ready.chunk == 3
            assert np.array_equal(await s.step({}), want)

    run(main())
