"""web/cli.py: the worldserve command (models, generate in-process, serve as a real process)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import av
import pytest
import torch
from safetensors.torch import save_file
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from models import registry
from models.registry import save_world
from models.taehv import TAEHV, TAEHVConfig
from tests.web.conftest import recv, send
from web import app, cli
from web import messages as m
from web.cli import main, script_actions
from web.errors import ServerError
from web.hub import ServerConfig
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
    assert len(frames) == 11 and stream.average_rate == 15
    assert (frames[0].width, frames[0].height) == (256, 256)  # a 32 px world is upscaled 8x by default


def test_unknown_model_exits_with_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", "--model", "no-such-world", "--out", str(tmp_path / "run.mp4")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "cannot load no-such-world: unknown model 'no-such-world'; registered: tiny-random" in line


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


def test_compile_flag_sets_batch_buckets_up_to_max_batch():
    from web.cli import _load, _parser

    args = _parser().parse_args(
        ["serve", "--model", "tiny-random", "--device", "cpu", "--max-batch", "3", "--compile", "inductor"]
    )
    (world,) = _load(args.model, args).values()
    assert world.buckets == (1, 2, 4) and world.bucket(3) == 4  # compiled lazily, at the first chunk
    args = _parser().parse_args(["serve", "--model", "tiny-random", "--device", "cpu"])
    (world,) = _load(args.model, args).values()
    assert world.buckets is None and world.bucket(3) is None  # eager: any batch size, no padding


# -- startup errors: one line, exit 2, before any model work -------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def one_error_line(err: str) -> str:
    lines = err.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("worldserve: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--port", "99999"], "--port 99999"),
        (["serve", "--port", "BUSY"], "in use"),
        (["serve", "--device", "cuda"], "CUDA is not available"),
        (["generate", "--device", "cuda:0"], "CUDA is not available"),
        (["serve", "--device", "gpu"], "not a device"),
        (["serve", "--threads", "0"], "--threads 0"),
        (["generate", "--out", "MISSING/run.mp4"], "does not exist"),
        (["generate", "--actions", "d*x"], "--actions"),
    ],
)
def test_startup_errors_are_one_line_before_any_model_work(
    argv: list[str],
    says: str,
    busy_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_model_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("a world was loaded before the settings were checked")

    monkeypatch.setattr(app, "load_worlds", no_model_work)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    argv = [str(busy_port) if a == "BUSY" else a.replace("MISSING", str(tmp_path / "missing")) for a in argv]
    assert main(argv) == 2
    assert says in one_error_line(capsys.readouterr().err)


def test_device_and_dtype_default_to_auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cli._parser().parse_args(["serve"]).device == "auto"
    assert cli._parser().parse_args(["generate"]).device == "auto"
    loaded: list[tuple[str, str]] = []

    def load(names: object, device: str, dtype: str) -> None:
        loaded.append((device, dtype))
        raise OSError("stop here")  # reported as a load failure: exit 2

    monkeypatch.setattr(app, "load_worlds", load)
    out = ["--out", str(tmp_path / "run.mp4")]
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert main(["generate", *out]) == 2
    assert main(["generate", *out, "--device", "cuda", "--dtype", "float32"]) == 2  # a flag still decides
    # bfloat16 on CUDA: the float32 default made a published world's pool twice the size
    assert loaded == [("cpu", "float32"), ("cuda", "bfloat16"), ("cuda", "float32")]


def test_port_in_use_exits_2_with_one_line(busy_port: int) -> None:
    cmd = [sys.executable, "-m", "web.cli", "serve", "--port", str(busy_port)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert f"127.0.0.1:{busy_port}" in line and done.stdout == ""


# -- shutdown ------------------------------------------------------------------------------------


def dropped_frames(url: str) -> float:
    """The server's `worldserve_dropped_frames_total` for raw frames (0 before any)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('worldserve_dropped_frames_total{codec="raw"}'):
                return float(line.split()[-1])
    return 0.0


async def stalled_client(ws_url: str) -> ClientConnection:
    """A client that reads nothing after the handshake (tiny receive buffer): the server's send
    blocks and its outbox fills."""
    host, port = ws_url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    ws = await ws_connect(ws_url, sock=sock, proxy=None, compression=None, max_size=None)
    ws.transport.pause_reading()
    return ws


def test_sigterm_drains_briefly_and_tells_every_session() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "web.cli", "serve", "--model", "tiny-random", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    async def clients(url: str, ws_url: str) -> list[m.ServerMessage]:
        stalled = await stalled_client(ws_url)
        await send(stalled, m.Open(seed=1, mode="realtime", codec="raw", max_ahead=64))
        while dropped_frames(url) == 0:  # its outbox is full: the server has frames it cannot send
            await asyncio.sleep(0.1)
        oneshot = await ws_connect(ws_url, proxy=None, compression=None, max_size=None)
        await send(oneshot, m.Generate(chunks=10_000, codec="jpeg"))
        got = [await recv(oneshot)]
        while not isinstance(got[-1], m.Frames):  # the one-shot is running once frames come
            got.append(await recv(oneshot))
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(ConnectionClosed):
            while True:
                got.append(await recv(oneshot))
        # Behavioural bound, not a speed claim: the drain is <= 2 s; without one, the stalled
        # socket (still open, still not reading) held the exit for 11-18 s.
        try:
            assert await asyncio.to_thread(proc.wait, 8) == 0
        finally:
            stalled.transport.abort()
        return got

    try:
        line = proc.stdout.readline()
        assert "open http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split("open ")[1].split()[0]
        ws_url = url.replace("http://", "ws://") + "/v1/session"
        got = asyncio.run(clients(url, ws_url))
        assert got[-1] == m.Closed(reason="shutdown"), got[-3:]
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_serve_leaves_a_core_for_the_event_loop_and_the_encoders(monkeypatch) -> None:
    for cores, threads in (({0, 1}, 1), (set(range(16)), 15), ({3}, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, c=cores: c, raising=False)
        assert cli._parser().parse_args(["serve"]).threads == threads
    assert cli._parser().parse_args(["serve", "--threads", "2"]).threads == 2
    assert cli._parser().parse_args(["generate", "--out", "x.mp4"]).threads is None  # torch's own


# -- start-up cost: parsing imports no model code ------------------------------------------------

PARSE_ONLY = """
import contextlib, io, sys
from web import cli
for argv in ARGVS:
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out, \\
            contextlib.redirect_stderr(io.StringIO()) as err:
        cli.main(argv)
    assert "usage:" in out.getvalue() + err.getvalue(), argv
heavy = ("torch", "diffusers", "numpy", "gymnasium", "tqdm", "runtime", "sessions")
modules = ("models.registry", "models.world", "web.app", "web.server", "web.sdk")
print(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m.startswith(modules)))
"""


def test_help_and_usage_errors_load_no_torch() -> None:
    """`worldserve --help`, every command's --help and argument errors answer before torch,
    diffusers or a model module loads (they took 4-8 s on 2 busy cores; now about 0.25 s)."""
    commands = ["serve", "generate", "models", "convert", "parity", "record", "replay", "rollout"]
    argvs = [["--help"], *([c, "--help"] for c in commands), ["serv"], ["serve", "--port", "x"]]
    argvs += [["serve", "--device-memory", "lots"], ["convert", "--from", "nope", "x", "--out", "y"]]
    code = PARSE_ONLY.replace("ARGVS", repr(argvs))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"  # no heavy module was imported


# -- the sessions' K/V state against the device's memory -----------------------------------------


def test_serve_says_how_many_sessions_the_budget_holds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The session count stands (admission is by bytes, so smaller worlds' sessions can use the
    room); one warning line says how many sessions of the world the budget holds."""
    from web import memory

    retention = ServerConfig().retention  # serve's default rewind retention is charged too
    cost = memory.pool_cost({"w": registry.from_name("tiny-random")}, pipelined=False, retention=retention)
    started: list[tuple[int, int | None]] = []

    async def serve(server) -> None:  # instead of listening: what the server would be started with
        started.append((server.config.max_sessions, server.config.device_memory))

    monkeypatch.setattr(cli, "_serve_until_signalled", serve)
    argv = ["serve", "--model", "tiny-random", "--device", "cpu", "--port", "0", "--threads", "1"]
    argv += ["--retention", str(retention)]  # told: without it, serve lowers the retention first
    budget = cost.total(3) + 1
    assert main([*argv, "--device-memory", str(budget)]) == 0
    assert main([*argv, "--device-memory", str(budget), "--max-sessions", "2"]) == 0
    assert started == [(16, budget), (2, budget)]
    said = [r.getMessage() for r in caplog.records if "holds" in r.getMessage()]
    assert len(said) == 1 and "holds 3 sessions of tiny-random, not --max-sessions 16" in said[0]


def test_serve_says_in_one_line_when_not_even_one_session_fits(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--model", "tiny-random", "--device", "cpu", "--port", "0", "--device-memory", "1KiB"]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "one session of tiny-random needs" in line and "the budget is 1.0 KiB (--device-memory)" in line
    assert "--dtype bfloat16" in line


def test_generate_reserves_one_session(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = []
    load_worlds = app.load_worlds

    def load(*args, **kwargs):
        loaded.append(load_worlds(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(app, "load_worlds", load)
    out = tmp_path / "run.mp4"
    assert main(["generate", "--model", "tiny-random", "--chunks", "1", "--out", str(out)]) == 0
    (world,) = loaded[0].values()
    assert world.transformer.pool.rows == 2  # the session and a reset's spare (the engine's 16 + 1 before)


# -- expected user errors: one line, exit 2 -------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_missing_model_directory_is_named_as_a_path(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such-dir"
    extra = ["--port", "0"] if command == "serve" else ["--out", str(tmp_path / "run.mp4")]
    assert main([command, "--model", str(missing), *extra]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"model directory {missing} does not exist" in line and "unknown model" not in line


def test_generate_names_a_key_the_world_does_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    """Key names are the world's own: checked once it is loaded, in one line."""
    argv = ["generate", "--model", "tiny-random", "--device", "cpu", "--actions", "d,jump", "--out"]
    assert main([*argv, "/tmp/never-written.mp4"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--actions: item 1 ('jump'): unknown key(s) ['jump']; valid keys are" in line


def test_serve_without_retention_takes_what_leaves_room_for_its_sessions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from web import memory

    caplog.set_level("INFO")
    world = {"w": registry.from_name("tiny-random")}
    started: list[int] = []

    async def serve(server) -> None:
        started.append(server.config.retention)

    monkeypatch.setattr(cli, "_serve_until_signalled", serve)
    argv = ["serve", "--model", "tiny-random", "--device", "cpu", "--port", "0", "--threads", "1"]
    room_for_one_chunk = memory.pool_cost(world, pipelined=False, retention=1).total(16)
    assert main([*argv, "--device-memory", str(room_for_one_chunk)]) == 0
    assert main([*argv, "--device-memory", str(100 * room_for_one_chunk)]) == 0
    assert started == [1, ServerConfig().retention]
    assert any("rewind retention 1 chunks" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cluster", "--restarts", "-1"], "--restarts -1"),
        (["cluster", "--restart-window", "0"], "--restart-window 0"),
        (["cluster", "--replicas", "0"], "--replicas 0"),
        (["cluster", "--snapshot-interval", "-5"], "--snapshot-interval -5"),
    ],
)
def test_cluster_settings_are_checked_before_ray_starts(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class NoRay:
        def __getattr__(self, name: str) -> object:
            raise AssertionError("Ray was started before the settings were checked")

    monkeypatch.setitem(sys.modules, "ray", NoRay())
    assert main(argv) == 2
    assert says in one_error_line(capsys.readouterr().err)


def test_cluster_restart_flags_default_to_the_replica_specs_limits() -> None:
    pytest.importorskip("ray")
    from web.cluster.control import ReplicaSpec

    spec = ReplicaSpec(models=("tiny",), config=ServerConfig())
    args = cli._parser().parse_args(["cluster"])
    assert (args.restarts, args.restart_window) == (spec.restarts, spec.restart_window_s)
    args = cli._parser().parse_args(["cluster", "--restarts", "0", "--restart-window", "60"])
    assert (args.restarts, args.restart_window) == (0, 60.0)
