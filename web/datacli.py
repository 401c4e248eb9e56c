"""The data commands of ``worldserve`` (they need the ``gym`` extra and a running server).

    worldserve record  --url HOST:PORT [--model M] [--seed 0] [--steps 50] [--policy random] --out DIR
    worldserve replay  DIR [--url HOST:PORT]
    worldserve replay  LOG.json --out video.mp4|frames.npz [--device auto] [--dtype auto]
    worldserve rollout --url HOST:PORT [--model M] --episodes 64 --steps 100 --policy random|script:FILE
                       --concurrency 8 --out DIR

``record`` writes one episode (DIR/episode-00000), ``rollout`` many (DIR/episode-NNNNN, world seed
``--seed + N``; finished ones are skipped, so it resumes). ``replay`` plays an episode directory
(or every episode under DIR) back through a server and says whether the frames match: exit 0 when
bit-identical or its worst chunk's PSNR is at least ``--min-psnr`` (``--exact``: only when
bit-identical), else 1. Given a session log (a file: ``GET /v1/sessions/{id}/log``), ``replay``
re-renders it offline in-process instead, through the same engine (web/replaylog.py). A server
that cannot be reached or refuses the session (a wrong token or model) is one line on stderr and
exit status 2, as bad usage is.

The SDK, gymnasium and tqdm load only once a command runs: building the parser stays cheap.
"""

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from web.errors import ServerError, SessionClosed

__all__ = ["register"]

DEFAULT_URL = "127.0.0.1:8000"


def register(commands: Any) -> None:
    """Add ``record``, ``replay`` and ``rollout`` to the ``worldserve`` subcommand parser."""
    record = commands.add_parser("record", help="record one episode from a running server")
    _session_args(record)
    record.add_argument("--seed", type=int, default=0, help="world seed (default: %(default)s)")
    record.add_argument("--steps", type=int, default=50, help="chunks to record (default: %(default)s)")
    record.set_defaults(run=_record)

    replay = commands.add_parser(
        "replay", help="play recorded episodes back and compare the frames, or re-render a session log"
    )
    replay.add_argument(
        "dir", type=Path, help="an episode directory, a directory of episodes, or a session log (JSON file)"
    )
    replay.add_argument("--url", default=DEFAULT_URL, help="server (default: %(default)s)")
    replay.add_argument("--token", default=None, help="server token, if it requires one")
    replay.add_argument(
        "--min-psnr",
        type=float,
        default=30.0,
        help="pass mark when not bit-identical, dB (default: %(default)s)",
    )
    replay.add_argument("--exact", action="store_true", help="pass only when bit-identical")
    # a session log (web/replaylog.py) renders in-process with these
    replay.add_argument("--out", type=Path, default=None, help="log: video.mp4, or frames.npz (raw frames)")
    replay.add_argument("--model", default=None, help="log: load the log's model from this directory")
    replay.add_argument("--device", default="auto", help="log: auto, cpu, cuda, cuda:1, ... (default: auto)")
    replay.add_argument("--dtype", default="auto", help="log: auto, float32, bfloat16 or float16")
    replay.add_argument("--threads", type=int, default=None, help="log: torch threads (default: torch's)")
    replay.set_defaults(run=_replay)

    rollout = commands.add_parser("rollout", help="record many episodes at once (batched on the server)")
    _session_args(rollout)
    rollout.add_argument(
        "--seed", type=int, default=0, help="episode N gets world seed SEED + N (default: 0)"
    )
    rollout.add_argument("--episodes", type=int, default=64, help="(default: %(default)s)")
    rollout.add_argument("--steps", type=int, default=100, help="chunks per episode (default: %(default)s)")
    rollout.add_argument("--concurrency", type=int, default=8, help="sessions at once (default: %(default)s)")
    rollout.set_defaults(run=_rollout)


def _session_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="server (default: %(default)s)")
    parser.add_argument("--model", default=None, help="world (default: the server's default)")
    parser.add_argument("--token", default=None, help="server token, if it requires one")
    parser.add_argument(
        "--policy", default="random", help="random, or script:FILE defining policy(obs, t, action_space)"
    )
    parser.add_argument("--video", default="npz", choices=["npz", "mp4"], help="frames format (default: npz)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")


def _fail(message: str) -> int:
    print(f"worldserve: error: {message}", file=sys.stderr)
    return 2


def _server_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run ``command``; a server that is not there, refuses the session or closes it, and a path
    that cannot be written, are the user's to fix (start the server, pass --url, --token, --model
    or another --out): one line and exit 2, no traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (ServerError, SessionClosed, OSError) as exc:  # ServerUnreachable is an OSError
            return _fail(str(exc))
        except ModuleNotFoundError as exc:
            if exc.name != "gymnasium":
                raise
            name = command.__name__.removeprefix("_")
            return _fail(f"{name} needs gymnasium: pip install 'worldserve[gym]'")

    return run


@_server_errors
def _record(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from web.sdk.gym_env import WorldEnv
    from web.sdk.record import RecordEpisode
    from web.sdk.rollout import load_policy

    try:
        policy = load_policy(args.policy)
    except ValueError as exc:
        return _fail(str(exc))
    env = RecordEpisode(WorldEnv(args.url, args.model, token=args.token), args.out, video=args.video)
    try:
        obs, _ = env.reset(seed=args.seed)
        env.action_space.seed(args.seed)
        for t in tqdm(range(args.steps), unit="chunk", desc="record"):
            obs, *_ = env.step(policy(obs, t, env.action_space))
    finally:
        env.close()
    print(f"worldserve: recorded {args.steps} chunks to {args.out / 'episode-00000'}")
    return 0


@_server_errors
def _replay(args: argparse.Namespace) -> int:
    if args.dir.is_file():
        from web import replaylog

        return replaylog.run(args)
    from web.sdk.record import is_complete
    from web.sdk.replay import replay

    if not args.dir.is_dir():
        return _fail(f"{args.dir} does not exist")
    dirs = (
        [args.dir]
        if is_complete(args.dir)
        else sorted(d for d in args.dir.glob("episode-*") if is_complete(d))
    )
    if not dirs:
        return _fail(f"no recorded episode in {args.dir}")
    ok = True
    for d in dirs:
        report = asyncio.run(replay(args.url, d, token=args.token))
        print(f"{d}: {report.summary()}")
        ok &= report.identical or (not args.exact and report.psnr_min >= args.min_psnr)
    return 0 if ok else 1


@_server_errors
def _rollout(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from web.sdk.record import is_complete
    from web.sdk.rollout import episode_dir, load_policy, rollout

    try:
        policy = load_policy(args.policy)
    except ValueError as exc:
        return _fail(str(exc))
    if args.episodes < 0 or args.steps < 1 or args.concurrency < 1:
        return _fail("rollout needs --episodes >= 0, --steps >= 1, --concurrency >= 1")
    todo = sum(not is_complete(episode_dir(args.out, i)) for i in range(args.episodes))
    bar = tqdm(total=todo * args.steps, unit="chunk", desc="rollout")
    try:
        result = asyncio.run(
            rollout(
                args.url,
                args.out,
                episodes=args.episodes,
                steps=args.steps,
                policy=policy,
                concurrency=args.concurrency,
                model=args.model,
                seed=args.seed,
                video=args.video,
                token=args.token,
                on_step=lambda _: bar.update(1),
            )
        )
    except BaseException:
        bar.leave = False  # cleared: the error's line replaces it
        raise
    finally:
        bar.close()
    print(result.summary())
    return 0
