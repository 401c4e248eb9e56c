"""A converted tiny Matrix-Game 2.0 directory served end to end: `worldserve convert`, then a
real server on 127.0.0.1, a websocket session started from an image, keys and mouse."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models import registry
from models.matrix_game.clip_vision import CLIPVision, CLIPVisionConfig
from tests.fixtures.golden import GOLDEN, load_golden
from tests.fixtures.golden.served import write_tiny_vae
from web import messages as m
from web.cli import main

from .conftest import dial, recv, run, send, serving


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("mg")
    _w, meta = load_golden("matrix_game_universal_tiny")
    (tmp / "config.json").write_text(json.dumps(meta["config"]))
    torch.manual_seed(0)  # a tiny CLIP tower in the original layout, 1280 wide like ViT-H (5 tokens)
    tower = CLIPVision(CLIPVisionConfig(image_size=28, dim=1280, num_heads=16, num_layers=2, mlp_ratio=1.0))
    save_file(
        {f"visual.{k}": v.contiguous() for k, v in tower.state_dict().items()}, str(tmp / "clip.safetensors")
    )
    out = tmp / "world"
    args = ["convert", "--from", "matrix-game-2", str(GOLDEN / "matrix_game_universal_tiny.safetensors")]
    args += [str(tmp / "clip.safetensors"), "--config", str(tmp / "config.json"), "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    ws = json.loads((out / "worldserve.json").read_text())
    assert ws["requires"] == ["vae"]  # nothing else is missing: the action module and I2V now run
    write_tiny_vae(out)  # the converter takes only the published full-size Wan VAE
    ws["requires"] = []
    ws["world"] = {"id": "mg", "height": 32, "width": 48}  # a small frame (the published: 352x640)
    ws["inference"]["cond_frames"] = 4
    (out / "worldserve.json").write_text(json.dumps(ws))
    return out


def test_a_converted_directory_loads_with_its_action_space(mg_dir: Path) -> None:
    world = registry.load_world(mg_dir)
    spec = world.spec
    assert spec.image_start and spec.action_space.keys == ("w", "s", "a", "d") and spec.action_space.mouse
    assert (spec.width, spec.height, spec.chunk_frames) == (48, 32, 12)
    assert world.transformer.cfg.action.kind == "matrix-game" and world.transformer.cfg.image_dim == 1280
    world.setup(1)
    assert world.transformer.pool.row_nbytes() == world.kv_bytes_per_session()


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


async def _play(server, image: np.ndarray, actions: list[m.FrameAction]) -> list[np.ndarray]:
    ws = await dial(server)
    await send(ws, m.Open(model="mg", seed=3, image=image, mode="lockstep", codec="raw"))
    ready = await recv(ws)
    assert isinstance(ready, m.Ready), ready
    assert ready.frame is None  # the image conditions the world; it is not frame 0
    out = []
    for seq, act in enumerate(actions, 1):
        await send(ws, m.Step(seq=seq, actions=[act]))
        msg = await recv(ws, timeout=120)
        assert isinstance(msg, m.Frames), msg
        assert msg.frame0 == sum(len(f) for f in out)  # chunk 1 starts at frame 0
        out.append(msg.data)
        await send(ws, m.Ack(chunk=msg.chunk))
    await ws.close()
    return out


def test_served_over_a_websocket_keys_and_mouse_steer_the_world(mg_dir: Path) -> None:
    world = registry.load_world(mg_dir)

    async def go():
        async with serving({"mg": world}, default_model="mg") as server:
            url = f"http://127.0.0.1:{server.port}/v1/models"
            models = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(url).read()))
            assert "mg" in json.dumps(models) and "mouse" in json.dumps(models)
            image = _image(70, 50)  # not 32x48 and not its aspect ratio: cropped and resized
            fwd = await _play(server, image, [m.FrameAction(keys=("w",))] * 2)
            back = await _play(server, image, [m.FrameAction(keys=("s",))] * 2)
            look = await _play(server, image, [m.FrameAction(keys=("w",), mouse=(40.0, -20.0))] * 2)
            again = await _play(server, image, [m.FrameAction(keys=("w",))] * 2)
            return fwd, back, look, again

    fwd, back, look, again = run(go())
    assert fwd[0].shape == (9, 32, 48, 3) and fwd[1].shape == (12, 32, 48, 3)
    assert all(np.array_equal(a, b) for a, b in zip(fwd, again, strict=True))  # same inputs, same world
    assert not np.array_equal(fwd[1], back[1]) and not np.array_equal(fwd[1], look[1])


def test_bad_inputs_get_clear_errors_and_leave_the_session_alone(mg_dir: Path) -> None:
    world = registry.load_world(mg_dir)

    async def go():
        async with serving({"mg": world}, default_model="mg") as server:
            ws = await dial(server)
            await send(ws, m.Open(model="mg", prompt="a castle", image=_image(32, 48), mode="lockstep"))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and "prompt" in err.message
            await send(ws, m.Open(model="mg", mode="lockstep"))  # no image: the world has no default
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and "image" in err.message
            await ws.send(msgpack.packb({"type": "open", "model": "mg", "image": "not an image"}))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and "image" in err.message
            gray = {"dtype": "uint8", "shape": [4, 4], "data": bytes(16)}  # an array, but not RGB
            await ws.send(msgpack.packb({"type": "open", "model": "mg", "image": gray}))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and "image" in err.message
            await send(ws, m.Open(model="mg", seed=1, image=_image(300, 200), mode="lockstep", codec="raw"))
            assert isinstance(await recv(ws), m.Ready)
            await send(ws, m.Step(seq=1, actions=[m.FrameAction(keys=("space",))]))
            err = await recv(ws)
            assert isinstance(err, m.Error) and err.code == "invalid_field" and "space" in err.message
            await send(ws, m.Step(seq=2, actions=[m.FrameAction(keys=("a",), mouse=(5.0, 5.0))]))
            frames = await recv(ws, timeout=120)
            assert isinstance(frames, m.Frames) and frames.chunk == 1

    run(go())


def test_a_start_image_file_lets_sessions_open_without_an_image(mg_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    from models.actions import FrameAction
    from models.world import Conditioning
    from runtime.engine import Engine
    from runtime.requests import ChunkCommitted, ChunkRequest

    root = tmp_path / "with-start"
    shutil.copytree(mg_dir, root)
    picture = _image(40, 60, seed=5)
    Image.fromarray(picture).save(root / "start.png")
    ws = json.loads((root / "worldserve.json").read_text())
    ws["start_image"] = {"kind": "file", "path": "start.png"}
    (root / "worldserve.json").write_text(json.dumps(ws))
    engine = Engine({"mg": registry.load_world(root)}, max_streams=2)
    firsts = []
    for sid, image in (("default", None), ("explicit", picture)):
        engine.add_stream(sid, "mg", Conditioning(seed=2, image=image))
        engine.submit(ChunkRequest(sid, engine.new_request_id(), actions=[FrameAction(keys=frozenset("d"))]))
        outs = []
        while not outs:
            outs = [o for o in engine.step() if isinstance(o, ChunkCommitted)]
        firsts.append(outs[0].frames)
    assert np.array_equal(firsts[0], firsts[1])
    out = tmp_path / "mg.mp4"  # the one-shot CLI: chunk 1 takes the script's first 9 frames
    assert main(["generate", "--model", str(root), "--actions", "w*9,d*12", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
