"""web/cli.py: the worldserve command (models, generate in-process, serve as a real process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import av
import pytest
from safetensors.torch import save_file

from models import registry
from models.registry import save_world
from models.taehv import TAEHV, TAEHVConfig
from web.cli import main, script_actions
from web.errors import ServerError
from web.sdk import Client

ROOT = Path(__file__).parents[2]


def test_models_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert f"{registry.DEFAULT_MODEL}  (default)" in lines
    assert all(name in " ".join(lines) for name in registry.list_models())


def test_action_scripts_are_cut_into_chunks(worlds) -> None:
    tiny, image = worlds["tiny"], worlds["tiny-image"]
    # tiny: the first chunk has 3 frames (Wan's first latent frame is one frame), then 4 each
    chunks = script_actions(tiny, "d*5,a", None)
    assert [len(c) for c in chunks] == [3, 4]
    assert [sorted(a.keys) for a in chunks[1]] == [["d"], ["d"], ["a"], []]  # padded with idle
    assert [len(c) for c in script_actions(tiny, "w", 3)] == [3, 0, 0]  # past the script: no input
    assert len(script_actions(tiny, "", None)) == 8
    # image-started: the start image takes no action; scripted chunks have 4 frames
    assert [len(c) for c in script_actions(image, "w*8", None)] == [4, 4]
    with pytest.raises(ValueError):
        script_actions(tiny, "jump", None)


def test_generate_writes_an_mp4(worlds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "tiny"
    save_world(worlds["tiny"], model_dir)
    out = tmp_path / "run.mp4"
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--chunks",
                "3",
                "--actions",
                "d*4,w*4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "wrote 11 frames" in capsys.readouterr().out
    with av.open(str(out)) as video:
        stream = video.streams.video[0]
        frames = list(video.decode(stream))
    assert len(frames) == 11 and (frames[0].width, frames[0].height) == (32, 32) and stream.average_rate == 15


def test_unknown_model_exits_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-such-world"]) == 2
    assert "cannot load no-such-world" in capsys.readouterr().err


def test_generate_decodes_with_taehv_weights_from_a_local_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world_cfg, dit, _ = registry.tiny_random_configs()  # a tiny DiT on Wan-shaped latents
    dit = replace(dit, in_channels=16, out_channels=16, action=replace(dit.action, frames_per_latent=4))
    small = TAEHVConfig(enc_width=8, dec_widths=(8, 8, 8, 8), blocks=1)
    world = registry.build_world(replace(world_cfg, id="wan16"), dit, small, seed=0, decoder="taehv")
    save_world(world, tmp_path / "wan16")
    weights = tmp_path / "taew2_1.safetensors"
    save_file(TAEHV(TAEHVConfig()).state_dict(), str(weights))  # taew2_1's keys and shapes
    out = tmp_path / "run.mp4"
    args = ["generate", "--model", str(tmp_path / "wan16"), "--chunks", "2", "--out", str(out)]
    assert main([*args, "--decoder", f"taehv:{weights}"]) == 0
    assert "wrote 13 frames" in capsys.readouterr().out  # 2 latent frames a chunk: 1 + 4, then 8
    assert main([*args, "--decoder", "wan:x"]) == 2
    assert "expected taehv:PATH" in capsys.readouterr().err


def test_serve_prints_the_url_and_stops_on_sigint() -> None:
    env = {**os.environ, "WORLDSERVE_TOKEN": "t", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "web.cli",
        "serve",
        "--model",
        "tiny-random",
        "--port",
        "0",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "open http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split("open ")[1].split()[0]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url + "/healthz", timeout=30) as r:
            assert json.loads(r.read())["models"] == ["tiny-random"]
        with pytest.raises(ServerError, match="token"):  # WORLDSERVE_TOKEN is enforced
            Client(url)
        with Client(url, token="t") as world:
            assert world.step({}).shape == (3, 64, 64, 3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
