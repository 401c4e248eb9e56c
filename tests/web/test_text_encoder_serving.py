"""A converted tiny Self-Forcing world served with a tiny UMT5 text encoder in the server
(`serve --text-encoder DIR`): typed prompts open, reset and generate worlds; a prompt is
encoded once (a cache hit in /metrics after); the encode runs on the prompt worker, never on the
event loop or the engine thread; a prompt over the world's text length is `invalid_field`."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from models.prompts import save_prompt_embeds
from models.text_prompts import EncodedPrompts
from models.world import World
from tests.fixtures.golden.served import write_self_forcing_dir, write_umt5_dir
from tests.web.conftest import dial, recv, recv_until, run, send, serving
from tests.web.test_routes import fetch
from web import cli
from web import messages as m
from web.sdk import aio

PROMPT, OTHER = "a red car on a beach", "a castle at night"
TOO_LONG = "a long road " * 8  # 25 tokens with its EOS: the tiny world takes 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("sf_text")
    enc = tmp / "umt5"
    enc.mkdir()
    return write_self_forcing_dir(tmp), write_umt5_dir(enc)


def load(argv: list[str]) -> dict[str, World]:
    args = cli._parser().parse_args(["serve", *argv, "--device", "cpu"])
    return cli._load(args.model, args)


@pytest.fixture
def worlds(dirs: tuple[Path, Path]) -> dict[str, World]:
    model, enc = dirs
    return load(["--model", str(model), "--text-encoder", str(enc)])


def cache_count(text: str, result: str) -> float:
    found = re.search(rf'^worldserve_prompt_cache_total{{result="{result}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def metrics(server) -> str:
    status, _, body = await fetch(server.url + "/metrics")
    assert status == 200
    return body.decode() if isinstance(body, bytes) else body


async def first_chunk(server, prompt: str) -> np.ndarray:
    async with aio.connect(server.url, mode="lockstep", codec="raw", seed=3, prompt=prompt) as s:
        return await s.step({})


def test_sdk_open_with_a_typed_prompt_encodes_it_once(worlds: dict[str, World]) -> None:
    source = worlds["self-forcing"].prompts
    assert isinstance(source, EncodedPrompts)
    threads: list[str] = []
    encode = source.encoder.encode_ids

    def spy(ids: list[int]) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return encode(ids)

    source.encoder.encode_ids = spy  # type: ignore[method-assign]

    async def main() -> None:
        async with serving(worlds, default_model="self-forcing") as server:
            before = await metrics(server)
            a = await first_chunk(server, PROMPT)
            mid = await metrics(server)
            b = await first_chunk(server, "  a red car\n on a  beach ")  # the same prompt, cleaned
            after = await metrics(server)
            other = await first_chunk(server, OTHER)
            assert np.array_equal(a, b) and not np.array_equal(a, other)
            assert cache_count(mid, "miss") - cache_count(before, "miss") == 1
            assert cache_count(after, "hit") - cache_count(mid, "hit") == 1
            assert cache_count(after, "miss") == cache_count(mid, "miss")
            assert re.search(r"^worldserve_prompt_cache_bytes [1-9]", after, re.M)

    run(main())
    assert threads == ["worldserve-prompts", "worldserve-prompts"]  # PROMPT, OTHER: never the engine's


def test_a_typed_prompt_gives_the_world_of_its_precomputed_embedding(
    dirs: tuple[Path, Path], worlds: dict[str, World], tmp_path: Path
) -> None:
    source = worlds["self-forcing"].prompts
    assert isinstance(source, EncodedPrompts)
    save_prompt_embeds(tmp_path, PROMPT, source.encoder.encode(PROMPT))
    precomputed = load(["--model", str(dirs[0]), "--prompt-embeds", str(tmp_path)])

    async def chunk(ws: dict[str, World]) -> np.ndarray:
        async with serving(ws, default_model="self-forcing") as server:
            return await first_chunk(server, PROMPT)

    assert np.array_equal(run(chunk(worlds)), run(chunk(precomputed)))


def test_generate_and_reset_take_typed_prompts_too_long_is_invalid_field(worlds: dict[str, World]) -> None:
    async def main() -> None:
        async with serving(worlds, default_model="self-forcing") as server:
            done = await aio.generate(server.url, chunks=1, seed=3, prompt=PROMPT, codec="raw")
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=TOO_LONG))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field", err
            assert err.message.startswith("prompt:") and "at most 16" in err.message, err.message
            await ws.close()
            ws = await dial(server)
            await send(ws, m.Open(mode="lockstep", codec="raw", seed=3, prompt=OTHER))
            await recv_until(ws, m.Ready)
            await send(ws, m.Reset(seq=1, prompt=TOO_LONG))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and not err.fatal, err
            await send(ws, m.Reset(seq=2, prompt=PROMPT))  # the session went on: a typed prompt
            await recv_until(ws, m.Ready)
            await send(ws, m.Step(seq=3, actions=(m.FrameAction(),)))
            got = await recv(ws)
            assert isinstance(got, m.Frames) and np.array_equal(got.data, done.frames[: len(got.data)])
            await ws.close()

    run(main())


def test_cli_refuses_two_sources_no_text_world_a_bad_dir(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    model, enc = dirs
    with pytest.raises(cli.StartupError, match="choose one"):
        load(["--model", str(model), "--text-encoder", str(enc), "--prompt-embeds", str(tmp_path)])
    with pytest.raises(cli.StartupError, match="no loaded model takes a prompt"):
        load(["--model", "tiny-random", "--text-encoder", str(enc)])
    with pytest.raises(cli.StartupError, match=r"--text-encoder .*tokenizer\.json"):
        load(["--model", str(model), "--text-encoder", str(tmp_path)])


def test_cli_generate_takes_a_typed_prompt_and_refuses_a_long_one(
    dirs: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    model, enc = dirs
    base = ["generate", "--model", str(model), "--device", "cpu", "--text-encoder", str(enc)]
    out = tmp_path / "run.mp4"
    assert cli.main([*base, "--prompt", TOO_LONG, "--chunks", "1", "--out", str(out)]) == 2
    assert "at most 16" in capsys.readouterr().err and not out.exists()
    assert cli.main([*base, "--prompt", PROMPT, "--chunks", "1", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
