"""A converted Self-Forcing world served on 127.0.0.1 with `--prompt-embeds`: `generate` and a
lockstep session give the same chunks for the same seed and prompt, the prompt matters, and a
prompt the server cannot encode is `invalid_field` while the session goes on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.prompts import save_prompt_embeds
from models.world import World
from tests.fixtures.golden import load_golden
from tests.fixtures.golden.served import write_self_forcing_dir
from tests.web.conftest import dial, recv, recv_until, run, send, serving
from tests.web.test_routes import fetch
from web import cli
from web import messages as m

PROMPT, OTHER = "a golden prompt", "another prompt"


@pytest.fixture(scope="module")
def sf_worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, World]:
    """Loaded through the CLI's own path: `serve --model DIR --prompt-embeds DIR`."""
    tmp = tmp_path_factory.mktemp("sf")
    model = write_self_forcing_dir(tmp)
    g, meta = load_golden("self_forcing_rollout")
    save_prompt_embeds(tmp / "embeds", PROMPT, g["prompt_embeds"][0, : meta["rollout"]["prompt_tokens"]])
    save_prompt_embeds(tmp / "embeds", OTHER, torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
    argv = ["serve", "--model", str(model), "--prompt-embeds", str(tmp / "embeds"), "--device", "cpu"]
    args = cli._parser().parse_args(argv)
    worlds = cli._load(args.model, args)
    assert worlds is not None
    return worlds


def _prompt_error(msg: m.ServerMessage) -> bool:
    return isinstance(msg, m.Error) and msg.code == "invalid_field" and msg.message.startswith("prompt:")


async def _lockstep(server, prompt: str, chunks: int) -> list[np.ndarray]:
    ws = await dial(server)
    await send(ws, m.Open(mode="lockstep", codec="raw", seed=5, prompt=prompt))
    await recv_until(ws, m.Ready)
    out = []
    for seq in range(chunks):
        await send(ws, m.Step(seq=seq, actions=(m.FrameAction(),)))
        got = await recv(ws)
        assert isinstance(got, m.Frames) and got.chunk == seq + 1, got
        out.append(got.data)
    await ws.close()
    return out


def test_generate_equals_lockstep_with_a_prompt_from_prompt_embeds(sf_worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(sf_worlds, default_model="self-forcing") as server:
            status, _, body = await fetch(server.url + "/v1/models")
            assert status == 200 and [x["prompts"] for x in json.loads(body)] == [True]
            ws = await dial(server)
            await send(ws, m.Generate(seed=5, prompt=PROMPT, chunks=3, codec="raw"))
            msgs = await recv_until(ws, m.Done)
            oneshot = [x.data for x in msgs if isinstance(x, m.Frames)]
            await ws.close()
            assert len(oneshot) == 3  # 3 chunks: past the 6-frame window (sink 1 + 5), so it rolled
            stepped = await _lockstep(server, PROMPT, 3)
            for a, b in zip(oneshot, stepped, strict=True):
                assert np.array_equal(a, b)
            other = await _lockstep(server, OTHER, 1)
            assert not np.array_equal(other[0], stepped[0])  # the prompt reaches the model

    run(main())


def test_bad_prompts_are_invalid_field_and_the_session_goes_on(sf_worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(sf_worlds, default_model="self-forcing") as server:
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=5, prompt="never embedded"))
            err = await recv(ws)
            assert _prompt_error(err), err
            await ws.close()
            ws = await dial(server)
            await send(ws, m.Generate(prompt="never embedded", chunks=1, codec="raw"))
            err = await recv(ws)
            assert _prompt_error(err), err
            await ws.close()
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=5, prompt=PROMPT))
            await recv_until(ws, m.Ready)
            await send(ws, m.Reset(seq=1, prompt="never embedded"))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and not err.fatal, err
            await send(ws, m.Step(seq=2, actions=(m.FrameAction(),)))
            first = await recv(ws)
            assert isinstance(first, m.Frames) and first.chunk == 1
            await send(ws, m.Reset(seq=3, prompt=OTHER))  # a known prompt resets into its world
            await recv_until(ws, m.Ready)
            await send(ws, m.Step(seq=4, actions=(m.FrameAction(),)))
            again = await recv(ws)
            assert isinstance(again, m.Frames) and not np.array_equal(again.data, first.data)
            await send(ws, m.Reset(seq=5))  # no prompt: the session keeps OTHER (and its seed)
            await recv_until(ws, m.Ready)
            await send(ws, m.Step(seq=6, actions=(m.FrameAction(),)))
            kept = await recv(ws)
            assert isinstance(kept, m.Frames) and np.array_equal(kept.data, again.data)
            await ws.close()
            assert len(server.runtime.manager) <= 1

    run(main())


def test_cli_generate_takes_a_prompt_and_refuses_an_unknown_one(tmp_path: Path, capsys) -> None:
    model = write_self_forcing_dir(tmp_path)
    save_prompt_embeds(tmp_path / "embeds", PROMPT, torch.randn(3, 32))
    base = ["generate", "--model", str(model), "--device", "cpu", "--prompt-embeds", str(tmp_path / "embeds")]
    out = tmp_path / "run.mp4"
    assert cli.main([*base, "--prompt", "unknown", "--chunks", "1", "--out", str(out)]) == 2
    assert "--prompt: no precomputed embedding" in capsys.readouterr().err and not out.exists()
    assert cli.main([*base, "--prompt", PROMPT, "--chunks", "2", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
