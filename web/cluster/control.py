"""The control plane of a cluster: start replicas as Ray actors, place new sessions, find a
token's session, drain a replica, bring a dead replica's sessions back elsewhere, and read every
replica's figures.

Routing holds no session state: placement reads each replica's own figures, a token names the
replica that made it (web/cluster/tokens.py), and a moved session is found by asking the
replicas. The one state is the failover vault: with a checkpoint interval, the latest snapshot
of every session (`Replica.checkpoints`), bounded in bytes; when a replica dies its sessions are
restored from it on the others, each at the chunk of its last checkpoint; then the control
starts a new, empty replica under the dead one's name, so the cluster is back to its size (at most
`ReplicaSpec.restarts` times per name within `ReplicaSpec.restart_window_s`: a replica that
crashes in a loop stays down, and says so in the log).
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import ray

from web.cluster.replica import Replica, ReplicaLoad
from web.cluster.tokens import TokenSigner
from web.hub import ServerConfig

__all__ = ["Cluster", "DrainReport", "NoRoom", "ReplicaSpec", "capacity"]

log = logging.getLogger(__name__)

NAMESPACE = "worldserve"
CALL_TIMEOUT_S = 10.0  # a replica that answers no control call in this long is left out
START_TIMEOUT_S = 600.0  # loading the worlds (GPU weights) may take minutes
LOCATE_TRIES = 10  # a moved session is asked for this many times, LOCATE_WAIT_S apart
LOCATE_WAIT_S = 0.1
FAILOVER_WAIT_S = 60.0  # how long a relay whose replica died waits for its session elsewhere
NAME_TRIES = 10  # a restarted replica takes its dead namesake's name this many times ...
NAME_WAIT_S = 0.5  # ... this far apart (Ray frees a dead actor's name soon after, not at once)


class NoRoom(RuntimeError):
    """The Ray cluster has no free resources for one more replica."""


@dataclass(frozen=True)
class ReplicaSpec:
    """How to start each replica."""

    models: tuple[str, ...]
    config: ServerConfig
    device: str = "cpu"  # "cuda" for GPU replicas (one GPU each)
    dtype: str = "float32"
    threads: int = 1  # torch threads of each replica's engine
    gpus: float = 0.0  # Ray resources each replica asks for
    cpus: float = 1.0
    host: str | None = "127.0.0.1"  # where replicas listen (None: their node's address)
    loader: Callable[[], dict[str, Any]] | None = None  # builds each replica's worlds instead of
    # the registry (``models`` is then ignored); importable by name in the replica's process
    namespace: str = NAMESPACE  # of the replicas' Ray names: one per cluster on a Ray cluster
    restarts: int = 3  # a dead replica is started again at most this often ...
    restart_window_s: float = 600.0  # ... within this many seconds (then it stays down)


@dataclass(frozen=True)
class DrainReport:
    """What a drain did: session id -> the replica it moved to; the ids left where they were."""

    replica: str
    moved: dict[str, str]
    kept: list[str]


@dataclass(frozen=True)
class Checkpoint:
    """A session's latest snapshot in the vault: where it lived, its last chunk, its bytes."""

    replica: str
    chunk: int
    data: bytes


@functools.cache
def _actor() -> Any:
    """The replica's Ray actor class (made once)."""
    return ray.remote(Replica)


def capacity(load: ReplicaLoad) -> int:
    """Sessions a replica can hold in all: its session cap, or fewer when its device budget
    (free bytes plus what its sessions use) holds fewer default-model sessions."""
    per = max(1, int(load["session_bytes"]))  # type: ignore[call-overload]
    by_bytes = (int(load["free_bytes"]) + int(load["used_bytes"])) // per  # type: ignore[call-overload]
    return min(int(load["max_sessions"]), by_bytes)  # type: ignore[call-overload]


class Cluster:
    """Replica handles by name, and the control calls on them (see the module docstring)."""

    def __init__(self, spec: ReplicaSpec, secret: bytes, vault_bytes: int = 1 << 30) -> None:
        """No replica yet (`start`, `add`); ``vault_bytes``: memory for the failover vault (see
        the module docstring)."""
        self.spec = spec
        self.secret = secret
        self.replicas: dict[str, Any] = {}  # name -> Ray actor handle
        self.urls: dict[str, str] = {}  # name -> the replica's websocket URL
        self.signer = TokenSigner(secret)
        self._next = 0  # the number of the next replica's name
        self._pending: Counter[str] = Counter()  # connections placed, not yet in the figures
        self._placing = asyncio.Lock()
        self.vault: dict[str, Checkpoint] = {}  # session id -> its latest checkpoint, oldest first
        self.vault_bytes = vault_bytes
        self._failing: dict[str, asyncio.Task[None]] = {}  # replica -> its failover
        self._restarting: dict[str, asyncio.Task[None]] = {}  # replica -> its restart
        self._background: set[asyncio.Task[None]] = set()  # kept: the loop holds weak refs
        self._crashes: dict[str, deque[float]] = {}  # replica -> when it was restarted (bounded)
        self._checkpointer: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, count: int, spec: ReplicaSpec, secret: bytes) -> "Cluster":
        """``count`` replicas (named replica-0 ...) on the Ray cluster this process joined."""
        cluster = cls(spec, secret)
        cluster._check_room(count)  # the adds below each see the room before any takes it
        await asyncio.gather(*(cluster.add() for _ in range(count)))
        return cluster

    def _check_room(self, count: int) -> None:
        """NoRoom unless the Ray cluster has the resources of ``count`` more replicas free (Ray
        would wait for a node with room forever)."""
        spec, free = self.spec, ray.available_resources()
        gpus, cpus = free.get("GPU", 0.0), free.get("CPU", 0.0)
        if count * spec.gpus > gpus or count * spec.cpus > cpus:
            raise NoRoom(
                f"{count} replicas need {count * spec.gpus:g} GPU and {count * spec.cpus:g} CPU; "
                f"the Ray cluster has {gpus:g} GPU and {cpus:g} CPU free"
            )

    async def add(self, name: str | None = None) -> str:
        """Start one more replica (it serves once its worlds are loaded) named ``name`` (a dead
        one's, restarted) or the next free name; returns its name."""
        spec = self.spec
        self._check_room(1)
        if name is None:
            name = f"replica-{self._next}"
            self._next += 1
        handle = (
            _actor()
            .options(name=name, namespace=spec.namespace, num_gpus=spec.gpus, num_cpus=spec.cpus)
            .remote(
                name,
                list(spec.models),
                spec.config,
                self.secret,
                spec.device,
                spec.dtype,
                spec.threads,
                spec.host,
                spec.loader,
                spec.namespace,
            )
        )
        try:
            url = await asyncio.wait_for(handle.start.remote(), START_TIMEOUT_S)
        except BaseException:
            ray.kill(handle)
            raise
        self.replicas[name] = handle
        self.urls[name] = url
        log.info("= replica %s serving at %s", name, url)
        return name

    async def remove(self, name: str) -> DrainReport:
        """Drain replica ``name``, then stop it; when a session found no other replica, it
        stays and serves on (the report lists it)."""
        report = await self.drain(name)
        if report.kept:
            return report
        handle = self.replicas.pop(name)
        self.urls.pop(name, None)
        try:
            await asyncio.wait_for(handle.stop.remote(), CALL_TIMEOUT_S)
        finally:
            ray.kill(handle)
        log.info("= replica %s removed", name)
        return report

    async def stop(self) -> None:
        """Stop every replica's server, then the actors."""
        if self._checkpointer is not None:
            self._checkpointer.cancel()
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*(h.stop.remote() for h in self.replicas.values()), return_exceptions=True)
        for h in self.replicas.values():
            ray.kill(h)

    async def _call(self, name: str, method: str, *args: Any) -> Any:
        ref = getattr(self.replicas[name], method).remote(*args)
        return await asyncio.wait_for(ref, CALL_TIMEOUT_S)

    async def loads(self) -> list[ReplicaLoad]:
        """Every answering replica's figures (`Replica.load`); one that fails is left out."""
        names = list(self.replicas)
        got = await asyncio.gather(*(self._call(n, "load") for n in names), return_exceptions=True)
        out = []
        for name, load in zip(names, got, strict=True):
            if isinstance(load, BaseException):
                log.warning("= replica %s did not answer: %s", name, load)
                continue
            out.append(load)
        return out

    async def place(self) -> str:
        """The replica for a new session: the one with the most free device bytes, less what
        the connections placed there but not yet counted in its figures will take; draining,
        dead and full replicas last (a full one then answers `busy` itself, as a single server)."""
        async with self._placing:
            loads = await self.loads()
            if not loads:
                raise RuntimeError("no replica answers")

            def score(load: ReplicaLoad) -> tuple[bool, bool, int, int]:
                name = str(load["name"])
                pending = self._pending[name]
                serving = not load["draining"] and not load["dead"]
                sessions, cap = int(load["sessions"]), int(load["max_sessions"])  # type: ignore[call-overload]
                # A placed session may be in the figures before its `ready` settles it: when the
                # pending ones fill every replica, one with room by its own count comes first.
                usable = serving and sessions + pending < cap
                room = serving and sessions < cap
                free = int(load["free_bytes"]) - pending * int(load["session_bytes"])  # type: ignore[call-overload]
                return usable, room, free, -(sessions + pending)

            name = str(max(loads, key=score)["name"])
            self._pending[name] += 1
            return name

    def placed(self, name: str) -> None:
        """A connection placed on ``name`` is now in its figures (its session is open), or gone."""
        if self._pending[name] > 0:
            self._pending[name] -= 1

    async def locate(self, token: str) -> str | None:
        """The replica whose session answers to ``token``: the one it names first, then the
        others (a drain moved it); None for a forged token or one no replica knows."""
        named = self.signer.replica_of(token)
        if named is None:
            return None
        order = [named] if named in self.replicas else []
        order += [n for n in self.replicas if n != named]
        for name in order:
            try:
                if await self._call(name, "has", token):
                    return name
            except Exception as exc:  # a dead replica: its sessions are elsewhere or gone
                log.warning("= replica %s did not answer: %s", name, exc)
        return None

    async def find_moved(self, token: str, previous: str, died: bool = False) -> str | None:
        """Where a session went after its replica let go of it (a drain), asked a few times:
        the move may still be finishing. ``died``: the replica dropped the socket; if it is dead
        the session comes back from its checkpoint (`suspect`), which takes longer. None:
        nowhere (it ended, or had no checkpoint)."""
        if died:
            await self.suspect(previous)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (FAILOVER_WAIT_S if died else LOCATE_TRIES * LOCATE_WAIT_S)
        while True:
            name = await self.locate(token)
            if name is not None and name != previous:
                return name
            if loop.time() >= deadline or (died and previous in self.replicas):
                return None  # ended; or the replica lives and only closed this socket
            await asyncio.sleep(LOCATE_WAIT_S)

    async def drain(self, name: str) -> DrainReport:
        """Move every session of replica ``name`` to the others (most free bytes first) and
        place nothing new on it: each is snapshotted after its outstanding chunks commit, held,
        restored elsewhere with its id and token, and only then let go of, so its client (through
        a front end) resumes there with no committed chunk lost. A session no replica takes
        stays where it was."""
        if name not in self.replicas:
            raise KeyError(f"no replica {name!r}; replicas: {sorted(self.replicas)}")
        handed: dict[str, bytes] = await asyncio.wait_for(
            self.replicas[name].hand_over.remote(), START_TIMEOUT_S
        )
        targets = [
            load
            for load in await self.loads()
            if load["name"] != name and not load["draining"] and not load["dead"]
        ]
        free = {str(t["name"]): int(t["free_bytes"]) for t in targets}  # type: ignore[call-overload]
        cost = {str(t["name"]): int(t["session_bytes"]) for t in targets}  # type: ignore[call-overload]
        batches: dict[str, dict[str, bytes]] = {t: {} for t in free}
        for sid, data in handed.items():
            if not free:
                break
            target = max(free, key=lambda t: free[t])
            batches[target][sid] = data
            free[target] -= cost[target]
        moved: dict[str, str] = {}
        for target, batch in batches.items():
            if batch:
                taken = await self._take_over(target, batch)
                moved.update({sid: target for sid in taken})
        kept = [sid for sid in handed if sid not in moved]
        await self._call(name, "let_go", list(moved))
        if kept:
            await self._call(name, "keep", kept)
        log.info("= drained %s: %d sessions moved, %d kept", name, len(moved), len(kept))
        return DrainReport(name, moved, kept)

    # -- failover -------------------------------------------------------------------------------

    def start_checkpoints(self, interval_s: float) -> None:
        """Checkpoint every replica's sessions every ``interval_s`` seconds from now on."""
        self._checkpointer = asyncio.get_running_loop().create_task(self._checkpoint_loop(interval_s))

    async def _checkpoint_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for name in list(self.replicas):
                try:
                    await self.checkpoint(name)
                except Exception:  # one round's failure must not end the checkpoints
                    log.exception("= checkpoint of replica %s failed", name)

    async def checkpoint(self, name: str) -> None:
        """Take the new checkpoints of replica ``name`` into the vault (sessions that ended
        there leave it); a dead replica's sessions fail over."""
        since = {sid: c.chunk for sid, c in self.vault.items() if c.replica == name}
        try:
            answer = await self._call(name, "checkpoints", since)
        except ray.exceptions.RayActorError:
            await self.suspect(name)
            return
        except Exception as exc:  # slow this round: its old checkpoints stay
            log.warning("= replica %s not checkpointed: %s", name, exc)
            return
        if answer is None:  # its engine thread died
            await self.suspect(name)
            return
        live, fresh = answer
        for sid in set(since) - set(live):
            del self.vault[sid]
        for sid, (chunk, data) in fresh.items():
            self.vault.pop(sid, None)  # to the end: the order is the age of the checkpoint
            self.vault[sid] = Checkpoint(name, chunk, data)
        while self.vault and sum(len(c.data) for c in self.vault.values()) > self.vault_bytes:
            sid = next(iter(self.vault))
            log.warning("= session %s has no checkpoint: the vault is full", sid)
            del self.vault[sid]

    async def suspect(self, name: str) -> None:
        """A replica did not answer, dropped a socket or said its engine thread died: if its
        process or its engine is dead, fail its sessions over (once, however many relays
        noticed); `_fail_over` stops a process whose engine died."""
        if name not in self.replicas:
            return
        task = self._failing.get(name)
        if task is None:
            try:
                if not (await self._call(name, "load"))["dead"]:
                    return  # alive
                log.error("= replica %s: its engine thread died; stopping it", name)
            except ray.exceptions.RayActorError:
                pass
            except Exception:  # slow, not dead: the next checkpoint round asks again
                return
            task = self._failing.get(name) or asyncio.ensure_future(self._fail_over(name))
            self._failing[name] = task
        await asyncio.shield(task)

    async def _fail_over(self, name: str) -> None:
        """Replica ``name`` died: forget it, restore each of its sessions from its last
        checkpoint on the others, then start it again (`_restart_later`)."""
        handle = self.replicas.pop(name, None)
        self.urls.pop(name, None)
        if handle is not None:
            with contextlib.suppress(Exception):  # dead (or its engine is): stopped, its name freed
                ray.kill(handle, no_restart=True)
        lost = {sid: c for sid, c in self.vault.items() if c.replica == name}
        log.error("= replica %s died; %d sessions come back from their checkpoints", name, len(lost))
        try:
            await self._restore_lost(name, lost)
        finally:
            self._restart_later(name)

    async def _restore_lost(self, name: str, lost: dict[str, Checkpoint]) -> None:
        """Each of the dead replica ``name``'s sessions from its checkpoint on the replica with
        the most free bytes; one no replica takes is forgotten."""
        loads = [x for x in await self.loads() if not x["draining"] and not x["dead"]]
        if not loads:
            log.error("= no replica left to take the sessions of %s", name)
            for sid in lost:
                self.vault.pop(sid, None)
            return
        free = {str(x["name"]): int(x["free_bytes"]) for x in loads}  # type: ignore[call-overload]
        cost = {str(x["name"]): int(x["session_bytes"]) for x in loads}  # type: ignore[call-overload]
        batches: dict[str, dict[str, bytes]] = {t: {} for t in free}
        for sid, c in lost.items():
            target = max(free, key=lambda t: free[t])
            batches[target][sid] = c.data
            free[target] -= cost[target]
        for target, batch in batches.items():
            if not batch:
                continue
            taken = await self._take_over(target, batch)
            for sid in taken:
                self.vault[sid] = replace(lost[sid], replica=target)
        for sid in lost:
            if self.vault.get(sid) is lost[sid]:  # no replica took it
                del self.vault[sid]

    def _restart_later(self, name: str) -> None:
        """Start a new, empty replica named ``name`` in the background (the relays waiting for
        the failover go on meanwhile), unless it was restarted `restarts` times in the window."""
        now = time.monotonic()
        spec = self.spec
        crashes = self._crashes.setdefault(name, deque(maxlen=max(1, spec.restarts)))
        while crashes and now - crashes[0] > spec.restart_window_s:
            crashes.popleft()
        if spec.restarts <= 0 or len(crashes) >= spec.restarts:
            log.error(
                "= replica %s died %d times within %.0f s: not restarted (the cluster serves on "
                "with %d replicas; `worldserve add-replica` starts another)",
                name,
                len(crashes) + 1,
                spec.restart_window_s,
                len(self.replicas),
            )
            return
        crashes.append(now)
        task = asyncio.get_running_loop().create_task(self._restart(name))
        self._restarting[name] = task
        task.add_done_callback(lambda _: self._restarting.pop(name, None))

    async def _restart(self, name: str) -> None:
        self._failing.pop(name, None)  # a later death of the new replica fails over again
        self._pending.pop(name, None)
        for attempt in range(NAME_TRIES):
            try:
                await self.add(name)
                break
            except (ValueError, NoRoom):  # Ray has not released the dead actor's name or CPUs yet
                if attempt == NAME_TRIES - 1:
                    log.exception("= replica %s could not be restarted", name)
                    return
                await asyncio.sleep(NAME_WAIT_S)
            except Exception:  # no room, or its worlds do not load: it stays down
                log.exception("= replica %s could not be restarted", name)
                return
        log.warning("= replica %s restarted (empty; takes new sessions)", name)

    async def _take_over(self, target: str, batch: dict[str, bytes]) -> list[str]:
        """`Replica.take_over` on ``target``; a replica that fails takes none (the caller keeps
        or drops them) instead of leaving a drain half done. The control owns the outcome: when
        the call fails or times out, sessions it may have restored meanwhile are discarded
        there (`Replica.discard`), so none lives on two replicas; a target that does not answer
        that either is stopped (its sessions fail over, and it restarts)."""
        try:
            return await asyncio.wait_for(self.replicas[target].take_over.remote(batch), START_TIMEOUT_S)
        except Exception as exc:
            log.error("= replica %s took none of %d sessions: %s", target, len(batch), exc)
        try:
            await self._call(target, "discard", list(batch))
        except ray.exceptions.RayActorError:  # dead: what it restored died with it
            self._later(self.suspect(target))
        except Exception as exc:
            log.error("= replica %s did not discard a failed move (%s): stopping it", target, exc)
            ray.kill(self.replicas[target], no_restart=True)
            self._later(self.suspect(target))
        return []

    def _later(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background (not awaited: a failover must not wait on another)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def metrics(self) -> dict[str, bytes]:
        """Every answering replica's Prometheus text by name."""
        names = list(self.replicas)
        got = await asyncio.gather(*(self._call(n, "metrics") for n in names), return_exceptions=True)
        return {n: t for n, t in zip(names, got, strict=True) if not isinstance(t, BaseException)}
