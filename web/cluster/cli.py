"""``worldserve cluster`` (engine replicas on Ray behind one front end) and ``worldserve drain``.

Registering the commands imports neither Ray nor torch: they are imported when a command runs.
"""

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlencode, urlsplit

from models.names import DEFAULT_MODEL
from web.hub import ServerConfig

__all__ = ["register"]

TOKEN_ENV = "WORLDSERVE_TOKEN"
JOB_POLL_S = 0.5


def register(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``cluster`` and ``drain`` to the ``worldserve`` command line."""
    d = ServerConfig()
    cluster = commands.add_parser(
        "cluster", help="serve worlds from engine replicas on Ray (one per GPU) behind one port"
    )
    cluster.add_argument(
        "--ray",
        default="local",
        metavar="local|ADDRESS",
        help="local: start Ray in this process; else the address of a running Ray cluster "
        "(e.g. auto, or HOST:6379) (default: %(default)s)",
    )
    cluster.add_argument(
        "--replicas", type=int, default=None, help="engine replicas (default: one per GPU, else 2 CPU ones)"
    )
    cluster.add_argument("--host", default="127.0.0.1", help="front end interface (default: %(default)s)")
    cluster.add_argument("--port", type=int, default=8000, help="front end port (default: %(default)s)")
    cluster.add_argument(
        "--model", action="append", default=None, help=f"registry name (repeatable; default: {DEFAULT_MODEL})"
    )
    cluster.add_argument("--device", default="auto", help="auto (CUDA replicas when Ray has GPUs), cpu, cuda")
    cluster.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    cluster.add_argument("--threads", type=int, default=1, help="torch threads per CPU replica")
    cluster.add_argument("--max-sessions", type=int, default=d.max_sessions, help="per replica")
    cluster.add_argument("--max-batch", type=int, default=d.max_batch, help="sessions per engine step")
    cluster.add_argument("--detach-ttl", type=float, default=d.detach_ttl_s, help="seconds")
    cluster.add_argument("--retention", type=int, default=d.retention, help="rewind chunks")
    cluster.add_argument("--token", default=None, help=f"server token (or env {TOKEN_ENV}); guards drain too")
    cluster.add_argument(
        "--snapshot-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="checkpoint every session this often; a replica that dies brings its sessions back "
        "on the others from their last checkpoint; 0: off (default: %(default)s)",
    )
    cluster.add_argument(
        "--restarts",
        type=int,
        default=3,
        metavar="N",
        help="a replica that dies is started again (empty, under its name) at most N times within "
        "--restart-window, then it stays down; 0: never (default: %(default)s)",
    )
    cluster.add_argument(
        "--restart-window", type=float, default=600.0, metavar="S", help="seconds (default: %(default)s)"
    )
    cluster.set_defaults(run=_cluster)

    drain = commands.add_parser(
        "drain", help="move every session of a cluster replica to the others (no committed chunk lost)"
    )
    drain.add_argument("replica", help="replica name, e.g. replica-0 (see GET /v1/cluster)")
    drain.add_argument("--url", default="http://127.0.0.1:8000", help="the front end (default: %(default)s)")
    drain.add_argument("--token", default=None, help=f"server token (or env {TOKEN_ENV})")
    drain.add_argument("--remove", action="store_true", help="then stop the replica (scale down)")
    drain.set_defaults(run=_drain)

    add = commands.add_parser("add-replica", help="start one more replica in a running cluster (scale up)")
    add.add_argument("--url", default="http://127.0.0.1:8000", help="the front end (default: %(default)s)")
    add.add_argument("--token", default=None, help=f"server token (or env {TOKEN_ENV})")
    add.set_defaults(run=_add)


def _cluster(args: argparse.Namespace) -> int:
    bad = [
        f"{flag} {value}: {why}"
        for flag, value, ok, why in (
            ("--replicas", args.replicas, args.replicas is None or args.replicas >= 1, "at least 1"),
            ("--restarts", args.restarts, args.restarts >= 0, "0 or more"),
            ("--restart-window", args.restart_window, args.restart_window > 0, "more than 0 seconds"),
            ("--snapshot-interval", args.snapshot_interval, args.snapshot_interval >= 0, "0 (off) or more"),
        )
        if not ok
    ]
    if bad:  # checked before Ray starts
        print(f"worldserve: error: {bad[0]}", file=sys.stderr)
        return 2
    import ray

    ray.init(address=None if args.ray == "local" else args.ray, include_dashboard=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    count = args.replicas or (gpus if device == "cuda" else 2)
    if count < 1:
        print(
            "worldserve: error: no GPU in the Ray cluster; pass --device cpu or --replicas", file=sys.stderr
        )
        return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
        default_model=None,
        max_sessions=args.max_sessions,
        max_batch=args.max_batch,
        detach_ttl_s=args.detach_ttl,
        retention=args.retention,
        realtime_headroom=0.0,
    )
    from web.cluster.control import NoRoom

    try:
        asyncio.run(_run_cluster(args, config, count, device, dtype))
    except NoRoom as exc:
        print(f"worldserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


async def _run_cluster(
    args: argparse.Namespace, config: ServerConfig, count: int, device: str, dtype: str
) -> None:
    from web.cluster.control import Cluster, ReplicaSpec
    from web.cluster.frontend import FrontEnd

    spec = ReplicaSpec(
        models=tuple(args.model or [DEFAULT_MODEL]),
        config=config,
        device=device,
        dtype=dtype,
        threads=args.threads,
        gpus=1.0 if device == "cuda" else 0.0,
        cpus=0.0 if device == "cuda" else float(args.threads),
        host="127.0.0.1" if args.ray == "local" else None,  # Ray started here: one machine
        restarts=args.restarts,
        restart_window_s=args.restart_window,
    )
    cluster = await Cluster.start(count, spec, secrets.token_bytes(32))
    if args.snapshot_interval > 0:
        cluster.start_checkpoints(args.snapshot_interval)
    front = FrontEnd(cluster, config)
    await front.start()
    print(f"worldserve: {count} {device} replicas; sessions at {front.ws_url} (protocol v1)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await front.stop()
    await cluster.stop()


def _admin(url: str, token: str | None) -> dict | None:
    """Start an admin job on the front end and wait for it; its final state, or None (after
    printing why) when it failed."""
    token = token or os.environ.get(TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = urlsplit(url)
    try:
        job = _get(url, headers)["job"]
        while True:
            state = _get(f"{base.scheme}://{base.netloc}{job}", headers)
            if state["state"] != "running":
                break
            time.sleep(JOB_POLL_S)
    except urllib.error.HTTPError as exc:
        print(f"worldserve: error: {exc.code} {exc.read().decode().strip()}", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"worldserve: error: cannot reach {url}: {exc}", file=sys.stderr)
        return None
    if state["state"] == "failed":
        print(f"worldserve: error: {state.get('error')}", file=sys.stderr)
        return None
    return state


def _get(url: str, headers: dict[str, str]) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as reply:
        return json.loads(reply.read())


def _drain(args: argparse.Namespace) -> int:
    action = "remove" if args.remove else "drain"
    query = urlencode({"replica": args.replica})
    report = _admin(f"{args.url.rstrip('/')}/v1/cluster/{action}?{query}", args.token)
    if report is None:
        return 1
    print(f"{args.replica}: {len(report['moved'])} sessions moved, {len(report['kept'])} kept")
    return 0 if not report["kept"] else 1


def _add(args: argparse.Namespace) -> int:
    report = _admin(f"{args.url.rstrip('/')}/v1/cluster/add", args.token)
    if report is None:
        return 1
    print(f"{report['replica']} serving")
    return 0
