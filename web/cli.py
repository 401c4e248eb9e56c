"""The ``worldserve`` command.

    worldserve serve    [--host 127.0.0.1] [--port 8000] [--model NAME]... [--device auto] [...]
    worldserve generate [--model NAME] [--seed 0] [--chunks N] [--actions "d*16,a*16"] --out run.mp4
                        (both: [--decoder taehv:PATH] decodes with TAEHV weights from a local file)
    worldserve models
    worldserve convert --from self-forcing|matrix-game-2|fastvideo SRC... [--config FILE] --out DIR
    worldserve parity --model DIR --golden FILE.safetensors   (web.paritycli)
    (serve, generate: [--prompt-embeds DIR] resolves prompts of text worlds from local files;
     [--dtype auto] is bfloat16 on CUDA and float32 on CPU; [--device-memory SIZE] bounds the
     sessions' K/V state, web/memory.py)
    worldserve record | replay | rollout   (web.datacli: episodes from a running server)

``serve`` loads the worlds (registry names or local model directories; the default is the
registry's ``DEFAULT_MODEL``), starts the engine, the sessions and the websocket/HTTP endpoint,
and prints the URL to open. ``generate`` runs a one-shot in-process through the same engine and
``SessionManager.generate`` and writes an MP4 (``--video``: worlds under 128 px are upscaled by
default, web.video). ``models`` lists the registered worlds.

Bad settings (a port out of range or in use, a device this machine lacks, an ``--out`` that
cannot be written) are found before any model loads: one line on stderr, exit status 2. So is a
model that cannot be loaded, and state that does not fit: once the weights are in, ``serve``
lowers ``--max-sessions`` to what the device-memory budget holds (one warning line), or exits
when not even one session fits, before the engine allocates anything.

Parsing imports no torch, diffusers or model code, so ``--help`` and a typo answer at once:
each command imports what it runs inside its function (see `_parser`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from models.names import DEFAULT_MODEL
from web import convertcli, datacli, memory, paritycli
from web.cluster import cli as clustercli
from web.hub import ServerConfig
from web.startup import (
    DTYPES,
    StartupError,
    check_bind,
    check_out,
    check_port,
    parse_size,
    resolve_device,
    resolve_dtype,
)

if TYPE_CHECKING:
    from models.actions import FrameAction
    from models.world import World
    from web.server import Server

__all__ = ["main", "script_actions"]

log = logging.getLogger("worldserve")
TOKEN_ENV = "WORLDSERVE_TOKEN"
DEFAULT_CHUNKS = 8  # `generate` without --chunks or --actions
SWITCH = {"auto": None, "on": True, "off": False}  # an auto|on|off flag's value (None: the engine decides)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``worldserve`` script; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if getattr(args, "threads", None) is not None and args.threads < 1:  # serve, generate
            raise StartupError(f"--threads {args.threads}: must be at least 1")
        return args.run(args)
    except StartupError as exc:
        print(f"worldserve: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    """The whole command line. Building it imports no torch, diffusers or model code (they take
    seconds): defaults come from light modules (web.hub, web.startup, models.names) and each
    command imports what it runs inside its own function. A new flag follows the same rule."""
    parser = argparse.ArgumentParser(prog="worldserve", description="Interactive world-model session server.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve worlds over websocket protocol v1")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=8000, help="port; 0 picks a free one (default: %(default)s)"
    )
    _model_args(serve, repeatable=True, threads=serve_threads())
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=16,
        help="live sessions at most (default: %(default)s); how many fit is up to --device-memory",
    )
    serve.add_argument(
        "--max-batch", type=int, default=4, help="sessions per engine step (default: %(default)s)"
    )
    serve.add_argument(
        "--realtime-headroom",
        type=_headroom,
        default=0.0,
        metavar="FRACTION|off",
        help="answer a realtime open `busy` once realtime sessions would need more than 1 - FRACTION "
        "of the measured chunk rate; off: never (default: %(default)s)",
    )
    _switch(
        serve,
        "--overlap-decode",
        "decode each batch on a second CUDA stream while the next batch denoises; "
        "auto: on when the device is CUDA",
    )
    _switch(
        serve,
        "--defer-clean-pass",
        "send each chunk's frames before its clean pass writes its K/V (lower latency); "
        "auto: on unless the decode overlaps",
    )
    serve.add_argument(
        "--detach-ttl",
        type=float,
        default=60.0,
        help="seconds a dropped session waits (default: %(default)s)",
    )
    serve.add_argument(
        "--token", default=None, help=f"require this token in open/generate (or env {TOKEN_ENV})"
    )
    serve.add_argument(
        "--retention",
        type=int,
        default=None,
        metavar="CHUNKS",
        help="chunks a session can `rewind` by; each costs a chunk of K/V ring slack and a decoder "
        'cache and plug-in state per session (docs/ENGINE.md, "Rewind"; default: '
        f"{ServerConfig().retention}, or fewer where that many would not leave room for --max-sessions)",
    )
    serve.add_argument(
        "--deterministic",
        action="store_true",
        help="a session's frames do not depend on which sessions share its batch (every batch "
        "runs padded to --max-batch, each session attending and decoding on its own), so a "
        "session log replays bit-identically on a busy server; costs speed "
        '(docs/ENGINE.md, "Reproducibility")',
    )
    serve.add_argument("--debug-hooks", action="store_true", help="accept open.debug (tests only)")
    _limit_args(serve)
    _state_args(serve)
    serve.set_defaults(run=_serve)

    generate = commands.add_parser("generate", help="one-shot: run a world in-process, write an MP4")
    _model_args(generate, repeatable=False, threads=None)
    generate.add_argument("--seed", type=int, default=0, help="world seed (default: %(default)s)")
    generate.add_argument(
        "--chunks",
        type=int,
        default=None,
        help=f"chunks to run (default: cover --actions, or {DEFAULT_CHUNKS})",
    )
    generate.add_argument(
        "--actions",
        default="",
        help='per-frame action script, e.g. "d*16,a*16,w+d*8,,space" (keys joined by +, *N repeats)',
    )
    generate.add_argument(
        "--prompt", default=None, help="prompt (text worlds; needs --prompt-embeds or --text-encoder)"
    )
    generate.add_argument(
        "--out", type=Path, default=Path("worldserve.mp4"), help="MP4 path (default: %(default)s)"
    )
    generate.add_argument(  # web.video.VideoStyle, spelled out: building the parser imports no codecs
        "--video",
        default="auto",
        choices=["auto", "native", "upscale", "yuv444"],
        help="upscale: nearest-neighbour to >= 256 px, plays everywhere; yuv444: model size, full colour "
        "(not every player); native: model size, 4:2:0; auto: upscale below 128 px (default: %(default)s)",
    )
    generate.set_defaults(run=_generate)

    models = commands.add_parser("models", help="list the registered worlds")
    models.set_defaults(run=_models)
    convertcli.register(commands)  # web/convertcli.py
    paritycli.register(commands)  # web/paritycli.py
    datacli.register(commands)  # web/datacli.py
    clustercli.register(commands)  # web/cluster/cli.py (Ray only when it runs)
    return parser


def _state_args(serve: argparse.ArgumentParser) -> None:
    """`serve`'s saved sessions and save games (web.hub.ServerConfig holds their defaults)."""
    d = ServerConfig()
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="on SIGTERM/SIGINT save every live and detached session here, and on start restore "
        "the sessions saved here (their resume tokens stay valid); default: off",
    )
    serve.add_argument(
        "--persist-timeout",
        type=float,
        default=d.persist_timeout_s,
        metavar="S",
        help="seconds saving the sessions may take on stop; those not saved by then are logged "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--host-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="offload: when --device-memory is full, detached sessions move to host memory "
        "(longest-detached first) and back on resume; past SIZE they go to --state-dir (or "
        "close); default: off (a full device closes the longest-detached session)",
    )
    serve.add_argument(
        "--max-snapshot",
        type=parse_size,
        default=d.max_snapshot,
        metavar="SIZE",
        help="bytes of a save game (`snapshot` answers too_large past it; a `restore` may be this "
        "big) (default: 8MiB)",
    )


def _limit_args(serve: argparse.ArgumentParser) -> None:
    """`serve`'s abuse limits (web.hub.ServerConfig holds their defaults)."""
    d = ServerConfig()
    serve.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open websockets; more get HTTP 503 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-connections-per-address",
        type=int,
        default=d.max_connections_per_address,
        metavar="N",
        help="open websockets from one client address (loopback too); more get HTTP 503; "
        "0: no such cap (default: a quarter of --max-connections)",
    )
    serve.add_argument(
        "--sessions-per-connection",
        type=int,
        default=d.sessions_per_connection,
        help="live sessions one connection may create, forks included (default: %(default)s)",
    )
    serve.add_argument(
        "--forks-per-connection",
        type=int,
        default=d.forks_per_connection,
        help="forks one connection may make (default: %(default)s)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds without a client message before a session is closed; 0: never (default: %(default)s)",
    )
    serve.add_argument(
        "--open-timeout",
        type=float,
        default=d.open_timeout_s,
        help="seconds a connection without a session may wait before its open (default: %(default)s)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="also accept websockets from this browser origin, e.g. https://app.example "
        "(repeatable; * for any; default: same origin and non-browser clients only)",
    )


def serve_threads() -> int:
    """`serve`'s torch threads (the engine thread's, `EngineThread`) when --threads is not given:
    every core this process may use but one, for the event loop and the frame encoders. On 2
    cores a second torch thread bought a lockstep tiny-world session nothing through the
    websocket (p50 141-163 ms a chunk against 133-166 with one) and doubled the CPU per chunk
    (benchmarks/server_overhead.py --threads 2 vs 1, 2026-12-04)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def _headroom(text: str) -> float | None:
    """--realtime-headroom's value: `off` (None) or a fraction in [0, 1)."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction in [0, 1) or off")
    return value


def _switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An auto|on|off flag (read through `SWITCH`)."""
    parser.add_argument(flag, default="auto", choices=list(SWITCH), help=f"{help} (default: %(default)s)")


def _model_args(parser: argparse.ArgumentParser, *, repeatable: bool, threads: int | None) -> None:
    parser.add_argument(
        "--model",
        action="append" if repeatable else "store",
        default=None,
        help="registry name or local model directory"
        + (" (repeatable; the first is the default)" if repeatable else "")
        + f" (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1, ..."
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPES)],
        help="weights and K/V state; auto: bfloat16 on CUDA, float32 on CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="device memory the sessions' state may take, shared by every loaded world, e.g. 40GiB; "
        "opens past it are answered busy (default: CUDA: the free memory after the weights load, less "
        f"{memory.CUDA_MARGIN * 100:.0f}%% of the device; CPU: {memory.CPU_SHARE * 100:.0f}%% of the "
        "available RAM)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=threads,
        help="torch intra-op threads (default: "
        + (
            "torch's)"
            if threads is None
            else f"{threads}: all cores but one, for the event loop and encoders)"
        ),
    )
    parser.add_argument(
        "--decoder", default=None, help="taehv:PATH: decode with TAEHV (taew2_1) weights from a local file"
    )
    parser.add_argument(
        "--prompt-embeds",
        type=Path,
        default=None,
        metavar="DIR",
        help="precomputed prompt embeddings, one safetensors file per prompt (docs/MODELS.md)",
    )
    parser.add_argument(
        "--text-encoder",
        type=Path,
        default=None,
        metavar="DIR",
        help="encode prompts of text worlds in the server: a local Wan directory "
        "(models_t5_umt5-xxl-enc-bf16.pth + google/umt5-xxl/tokenizer.json) or a diffusers Wan "
        "repository (text_encoder/ + tokenizer/); needs the [text] extra (docs/MODELS.md)",
    )
    parser.add_argument(
        "--text-encoder-device",
        default=None,
        help="device of the text encoder, e.g. cpu to keep its ~11 GB (bf16) off the GPU "
        "(default: --device; bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--text-encoder-threads",
        type=int,
        default=1,
        help="torch threads of the text encoder's worker (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-cache",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="bytes of encoded prompts kept, shared by every session, least recently used out "
        "(default: 256MiB)",
    )
    parser.add_argument(
        "--compile",
        default="off",
        choices=["off", "inductor", "graphs"],
        help="torch.compile the chunk forwards, one graph per batch bucket; graphs: plus CUDA graphs; "
        "meant for CUDA (on a small CPU the compiled tiny world ran slower than eager) "
        "(default: %(default)s)",
    )


def _engine_threads(threads: int | None) -> int:
    """The engine thread's torch threads (--threads, else torch's count). Only the engine thread
    runs torch ops on several threads (`EngineThread`: a second worker team slows every op); this
    one, which loads the worlds, keeps one."""
    import torch

    engine = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return engine


def _load(names: Sequence[str], args: argparse.Namespace) -> dict[str, World]:
    """The worlds of --model on --device in --dtype, with --decoder, --prompt-embeds and
    --compile applied; a world that cannot be loaded is a StartupError (one line)."""
    import torch

    from models import registry
    from models.prompts import PromptEmbeddings
    from web import app

    try:
        worlds = app.load_worlds(names, args.device, resolve_dtype(args.dtype, args.device))
        if args.decoder:
            worlds = {k: registry.with_decoder(w, args.decoder) for k, w in worlds.items()}
        if args.prompt_embeds is not None and args.text_encoder is not None:
            raise StartupError("--prompt-embeds and --text-encoder: choose one source of prompts")
        if args.prompt_embeds is not None:
            prompts = PromptEmbeddings(args.prompt_embeds)
            for w in worlds.values():
                w.prompts = prompts  # used by worlds with text_prompts only
        if args.text_encoder is not None:
            _attach_text_encoder(worlds, args)
        if args.compile != "off":
            top = getattr(args, "max_batch", 1)
            buckets = tuple(2**i for i in range(max(top - 1, 0).bit_length() + 1))  # 1, 2, 4 .. >= top
            for w in worlds.values():
                w.compile(buckets, mode="reduce-overhead" if args.compile == "graphs" else None)
        return worlds
    except torch.cuda.OutOfMemoryError as exc:
        raise StartupError(
            f"cannot load {', '.join(names)}: its weights do not fit in {args.device} memory "
            "(try --dtype bfloat16, or another --device)"
        ) from exc
    except (KeyError, OSError, ValueError) as exc:
        raise StartupError(f"cannot load {', '.join(names)}: {exc}") from exc


def _attach_text_encoder(worlds: dict[str, World], args: argparse.Namespace) -> None:
    """Load --text-encoder on --text-encoder-device and give it to every text world, with one
    prompt cache of --prompt-cache bytes; a StartupError when no loaded world takes text."""
    import torch

    from models import text_prompts
    from models.umt5.load import load_text_encoder

    device = resolve_device(args.text_encoder_device or args.device)
    dtype = getattr(torch, resolve_dtype("auto", device))
    try:
        encoder = load_text_encoder(args.text_encoder, device, dtype)
    except (OSError, ValueError, ImportError) as exc:
        raise StartupError(f"--text-encoder {args.text_encoder}: {exc}") from exc
    cache = text_prompts.PromptCache(args.prompt_cache or text_prompts.DEFAULT_CACHE_BYTES)
    if not text_prompts.attach(worlds.values(), encoder, cache):
        raise StartupError(f"--text-encoder: no loaded model takes a prompt ({', '.join(worlds)})")
    log.info("text encoder %s on %s (%s)", args.text_encoder, device, dtype)


def _device_budget(worlds: dict[str, World], args: argparse.Namespace, requested: int) -> memory.Budget:
    """The device-memory budget the engine sizes its pools from and admits sessions by (in bytes,
    every loaded world sharing it); one warning line when it holds fewer than ``requested``
    sessions of the largest world (opens past what fits get `busy`), a StartupError when not even
    one fits."""
    pipelined = SWITCH[getattr(args, "overlap_decode", "auto")]
    if pipelined is None:  # the engine's own default (runtime/engine.py)
        pipelined = any(w.device.type == "cuda" for w in worlds.values())
    budget = memory.device_budget(args.device, args.device_memory)
    retention = getattr(args, "retention", 0)
    if retention is None:  # serve's default: as much rewind as the budget has room for
        most = ServerConfig().retention
        retention = args.retention = memory.auto_retention(worlds, requested, budget, pipelined, most)
        if retention < most:
            log.info(
                "rewind retention %d chunks: %d would not leave room for --max-sessions %d "
                "(--retention sets it)",
                retention,
                most,
                requested,
            )
    fits = memory.fit_sessions(worlds, requested, budget, pipelined, args.device, retention)
    if fits < requested:
        per = memory.pool_cost(worlds, pipelined, retention).per_session
        log.warning(
            "the device-memory budget of %s (%s) holds %d sessions of %s, not --max-sessions %d: "
            "a session's state takes %s; opens past what fits are answered busy (--device-memory "
            "sets the budget)",
            memory.format_bytes(budget.nbytes),
            budget.source,
            fits,
            "the largest world" if len(worlds) > 1 else next(iter(worlds)),
            requested,
            memory.format_bytes(per),
        )
    return budget


# -- serve --------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from web.server import Server

    check_port(args.port)
    if args.max_sessions < 1:
        raise StartupError(f"--max-sessions {args.max_sessions}: must be at least 1")
    if args.retention is not None and args.retention < 0:
        raise StartupError(f"--retention {args.retention}: must be at least 0 chunks")
    args.device = resolve_device(args.device)
    check_bind(args.host, args.port)
    args.state_dir = _state_dir(args.state_dir)
    args.engine_threads = _engine_threads(args.threads)
    worlds = _load(args.model or [DEFAULT_MODEL], args)
    budget = _device_budget(worlds, args, args.max_sessions)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
        debug_hooks=args.debug_hooks,
        default_model=next(iter(worlds)),
        max_sessions=args.max_sessions,
        device_memory=budget.nbytes,
        detach_ttl_s=args.detach_ttl,
        retention=args.retention,
        deterministic=args.deterministic,
        max_batch=args.max_batch,
        realtime_headroom=args.realtime_headroom,
        overlap_decode=SWITCH[args.overlap_decode],
        defer_clean_pass=SWITCH[args.defer_clean_pass],
        engine_threads=args.engine_threads,
        prompt_threads=args.text_encoder_threads,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        sessions_per_connection=args.sessions_per_connection,
        forks_per_connection=args.forks_per_connection,
        idle_timeout_s=args.idle_timeout,
        open_timeout_s=args.open_timeout,
        allow_origins=tuple(args.allow_origin),
        state_dir=args.state_dir,
        persist_timeout_s=args.persist_timeout,
        host_memory=args.host_memory,
        max_snapshot=args.max_snapshot,
    )
    asyncio.run(_serve_until_signalled(Server(worlds, config)))
    return 0


def _state_dir(path: Path | None) -> Path | None:
    """`--state-dir`, created and checked writable before any model loads (StartupError)."""
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".worldserve-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(f"--state-dir {path}: {exc.strerror or exc}") from exc
    return path


async def _serve_until_signalled(server: Server) -> None:
    import torch

    try:
        await server.start()
    except OSError as exc:  # the port was taken between check_bind and now
        await server.stop()
        where = f"{server.config.host}:{server.config.port}"
        raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
    except torch.cuda.OutOfMemoryError as exc:  # the margin was too thin for this device
        await server.stop()
        raise StartupError(
            "out of device memory sizing the sessions' K/V pools from the --device-memory budget; "
            "give a smaller --device-memory"
        ) from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"worldserve: serving {', '.join(server.worlds)}; open {server.url}", flush=True)
    print(f"worldserve: sessions at {server.ws_url} (protocol v1); Ctrl-C stops", flush=True)
    await stop.wait()
    await server.stop()


# -- generate -----------------------------------------------------------------------------------


def script_actions(world: World, script: str, chunks: int | None) -> list[list[FrameAction]]:
    """One action list per scripted chunk from a per-frame action script (`models.action_script`
    syntax; key names from the world's action space).

    Each chunk takes as many script frames as it has video frames (image-started worlds first
    show their start image, which takes none); a chunk the script ends inside is padded with idle
    frames, and chunks past the script's end get no input. ``chunks`` None: just enough chunks
    to cover the script (8 without one).
    """
    from models.action_script import parse_action_script
    from models.actions import FrameAction

    frames = parse_action_script(script, world.spec.action_space.keys)
    first = world.start_frames  # latent frames before the first scripted chunk
    n = world.chunk_frames

    def count(i: int) -> int:
        return world.layout.video_frames(first + i * n, n)

    if chunks is None:
        chunks, covered = (0, 0) if frames else (DEFAULT_CHUNKS, 0)
        while covered < len(frames):
            covered += count(chunks)
            chunks += 1
    out: list[list[FrameAction]] = []
    start = 0
    for i in range(chunks):
        part = frames[start : start + count(i)]
        start += count(i)
        if not part:
            break
        out.append([FrameAction(keys) for keys in part] + [FrameAction()] * (count(i) - len(part)))
    return out + [[]] * (chunks - len(out))


def _generate(args: argparse.Namespace) -> int:
    from models.action_script import parse_action_script

    check_out(args.out)
    args.device = resolve_device(args.device)
    try:
        parse_action_script(args.actions)
    except ValueError as exc:
        raise StartupError(f"--actions: {exc}") from exc
    args.engine_threads = _engine_threads(args.threads)
    worlds = _load([args.model or DEFAULT_MODEL], args)
    _device_budget(worlds, args, 1)  # a one-shot is one session: it must fit
    (world,) = worlds.values()
    try:
        actions = script_actions(world, args.actions, args.chunks)
    except ValueError as exc:
        raise StartupError(f"--actions: {exc}") from exc
    started = time.perf_counter()
    if args.prompt and (problem := world.prompt_problem(args.prompt)) is not None:
        print(f"worldserve: --prompt: {problem}", file=sys.stderr)
        return 2
    written = asyncio.run(
        _run_oneshot(
            worlds,
            world,
            args.seed,
            actions,
            args.out,
            args.prompt,
            args.engine_threads,
            args.video,
            args.text_encoder_threads,
        )
    )
    spec = world.spec
    print(
        f"worldserve: wrote {written} frames ({written / spec.fps:.1f} s at {spec.fps:g} fps, "
        f"{spec.width}x{spec.height}) to {args.out} in {time.perf_counter() - started:.1f} s"
    )
    return 0


async def _run_oneshot(
    worlds: dict[str, World],
    world: World,
    seed: int,
    actions: list[list[FrameAction]],
    out: Path,
    prompt: str | None = None,
    threads: int | None = None,
    video: str = "auto",  # a web.video.VideoStyle
    prompt_threads: int = 1,
) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from sessions.events import FramesEvent, ReadyEvent, SessionEvent
    from sessions.manager import OpenParams
    from web.app import Runtime
    from web.video import Mp4Writer

    spec = world.spec
    # one session: one pool row
    runtime = Runtime.start(worlds, max_sessions=1, threads=threads, prompt_threads=prompt_threads)
    writer = Mp4Writer(out, spec.width, spec.height, spec.fps, style=video)  # type: ignore[arg-type]
    disk = ThreadPoolExecutor(1, thread_name_prefix="worldserve-mp4")  # one thread: chunks stay in order
    bar = tqdm(total=len(actions), unit="chunk", desc=spec.id)
    loop = asyncio.get_running_loop()
    writes: list[asyncio.Future[None]] = []

    def sink(event: SessionEvent) -> None:
        if isinstance(event, ReadyEvent) and event.frame is not None:  # the start image is frame 0
            writes.append(loop.run_in_executor(disk, writer.write, event.frame[None]))
        if isinstance(event, FramesEvent):
            writes.append(loop.run_in_executor(disk, writer.write, event.frames))
            bar.update(1)

    try:
        params = OpenParams(model=spec.id, seed=seed, prompt=prompt)
        await runtime.manager.generate(params, actions, len(actions), sink)
        await asyncio.gather(*writes)
    finally:
        bar.close()
        await loop.run_in_executor(disk, writer.close)
        disk.shutdown()
        await runtime.stop()
    return writer.frames


# -- models -------------------------------------------------------------------------------------


def _models(args: argparse.Namespace) -> int:
    from models import registry

    for name in registry.list_models():
        print(f"{name}{'  (default)' if name == DEFAULT_MODEL else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
