"""web/memory.py: the sessions' K/V state sized against a device-memory budget before any pool
is allocated (tiny worlds and tiny budgets: nothing large is ever allocated here)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models import registry
from models.causal_wan import CausalWan
from models.convert import self_forcing
from models.taehv import TAEHVConfig
from models.world import World
from runtime.engine import Engine
from sessions.errors import SessionBusy
from sessions.manager import OpenParams
from sessions.session import SessionStatus
from tests.runtime.conftest import small_world
from web import memory
from web.app import Runtime
from web.memory import Budget, device_budget, fit_sessions, pool_cost
from web.startup import StartupError, parse_size


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_estimate_is_what_the_engine_allocates(pipelined: bool) -> None:
    worlds = {"a": small_world(name="a"), "b": small_world(image_start=True, name="b")}
    cost = pool_cost(worlds, pipelined)
    Engine(worlds, max_streams=3, pipeline=pipelined)
    assert sum(w.transformer.pool.nbytes() for w in worlds.values()) == cost.total(3)


def test_two_worlds_cost_their_largest_session_not_a_row_in_every_world() -> None:
    worlds = {"a": small_world(name="a"), "b": small_world(image_start=True, name="b")}
    row = worlds["a"].row_bytes(0)
    cost = pool_cost(worlds, pipelined=False)
    assert cost.per_session == max(w.row_bytes(0) for w in worlds.values()) == row
    assert cost.fixed == 2 * sum(w.row_bytes(0) for w in worlds.values())


def test_the_server_admits_by_the_budget_it_is_given() -> None:
    """`device_memory` reaches the engine: with room for two sessions' bytes and sixteen allowed by
    count, the third `open` is `busy`; closing one makes room, and so does a detached session."""
    worlds = {"tiny": small_world()}
    budget = pool_cost(worlds, pipelined=False).total(2)

    async def main() -> None:
        runtime = Runtime.start(worlds, max_sessions=16, device_memory=budget, overlap_decode=False)
        try:
            m = runtime.manager
            first = await m.open(OpenParams(seed=1))
            await m.open(OpenParams(seed=2))
            with pytest.raises(SessionBusy, match="bytes"):
                await m.open(OpenParams(seed=3))
            await m.close(first)
            third = await m.open(OpenParams(seed=3))
            third.detach()
            fourth = await m.open(OpenParams(seed=4))  # the detached session gives way, as at the count
            assert third.status is SessionStatus.EXPIRED and fourth.status is SessionStatus.OPENING
        finally:
            await runtime.stop()

    asyncio.run(main())
    (world,) = worlds.values()
    assert world.free_rows == world.max_sessions  # the stopped engine gave every row back


def test_worlds_that_remember_count_their_atlases() -> None:
    world = registry.from_name("tiny-world")
    assert world.plugin.remembers
    atlas = world.session_bytes() - world.kv_bytes_per_session()
    cost = pool_cost({"w": world}, pipelined=False)
    assert atlas > 0 and cost.per_session == cost.fixed // 2 + atlas  # fixed: a spare and a padding row


def test_sessions_are_lowered_to_what_fits() -> None:
    worlds = {"tiny": small_world()}
    cost = pool_cost(worlds, pipelined=False)
    assert fit_sessions(worlds, 16, Budget(cost.total(3) + cost.per_session - 1, "test"), False, "cpu") == 3
    assert fit_sessions(worlds, 16, Budget(cost.total(16) * 4, "test"), False, "cpu") == 16  # never raised
    assert fit_sessions(worlds, 1, Budget(cost.total(1), "test"), False, "cpu") == 1


def test_when_one_session_does_not_fit_one_line_says_what_it_needs() -> None:
    worlds = {"tiny": small_world()}
    need = pool_cost(worlds, pipelined=False).total(1)
    with pytest.raises(StartupError) as caught:
        fit_sessions(worlds, 16, Budget(need - 1, "--device-memory"), False, "cpu")
    line = str(caught.value)
    assert "\n" not in line
    assert f"needs {memory.format_bytes(need)} of cpu memory" in line and "float32" in line
    assert "--device-memory" in line and "--dtype bfloat16" in line


def test_cuda_budget_is_free_memory_less_a_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)  # 2 GiB cached, free
    budget = device_budget("cuda:0")
    assert budget.nbytes == 102 * gib - int(141 * gib * memory.CUDA_MARGIN)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * gib, 8 * gib))
    assert device_budget("cuda").nbytes == 5 * gib - memory.CUDA_MARGIN_MIN  # a small device
    assert device_budget("cuda", given=40 * gib) == Budget(40 * gib, "--device-memory")


def test_cpu_budget_is_a_share_of_the_available_ram(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   32768000 kB\n")
    cgroup = tmp_path / "cgroup"
    assert memory.available_ram(meminfo, cgroup) == 32768000 * 1024  # no cgroup limit
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    assert memory.available_ram(meminfo, cgroup) == 32768000 * 1024
    (cgroup / "memory.max").write_text(f"{8 * 2**30}\n")  # a container's limit is lower
    (cgroup / "memory.current").write_text(f"{2 * 2**30}\n")
    assert memory.available_ram(meminfo, cgroup) == 6 * 2**30
    assert device_budget("cpu").nbytes == int(memory.available_ram() * memory.CPU_SHARE)


def test_sizes() -> None:
    assert parse_size("40GiB") == 40 * 2**30 and parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512") == 512 and parse_size("64mib") == 64 * 2**20
    for bad in ("lots", "40XB", "-1GiB", "0", "GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def self_forcing_size(dtype: torch.dtype) -> dict[str, World]:
    """A world of the published Self-Forcing's size (1.3B, 480x832, 21-frame window) on the meta
    device: every shape, no memory."""
    cfg, _, _ = registry.tiny_random_configs()
    with torch.device("meta"):
        transformer = CausalWan(self_forcing.model_config(self_forcing.PUBLISHED)).to(dtype=dtype)
    decoder = registry.build_decoder(TAEHVConfig(), "taehv", "meta", dtype)
    cfg = replace(cfg, id="sf", width=832, height=480)
    return {"sf": World(cfg, transformer, decoder, device="meta", dtype=dtype)}


def test_the_published_self_forcing_starts_with_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: fp32 and 16 + 2 rows asked for 108.7 GB for the K half alone and died on an
    H200. bfloat16 on CUDA (the default there) fits 16 sessions; float32 is lowered to what fits;
    a CPU budget that holds no float32 session is one line naming bfloat16."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (136 * gib, 139 * gib))  # weights in
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    h200 = device_budget("cuda")
    assert fit_sessions(self_forcing_size(torch.bfloat16), 16, h200, True, "cuda") == 16
    assert fit_sessions(self_forcing_size(torch.float32), 16, h200, True, "cuda") == 7
    with pytest.raises(StartupError, match=r"needs 34\.3 GiB of cpu memory .* try --dtype bfloat16"):
        fit_sessions(self_forcing_size(torch.float32), 16, Budget(32 * gib, "test"), False, "cpu")


def test_serve_picks_as_much_rewind_as_leaves_room_for_the_sessions_asked_for() -> None:
    """`serve` without --retention: up to 4 chunks, fewer where 4 would cost sessions."""
    worlds = {"a": small_world(name="a")}
    fits_with = {r: pool_cost(worlds, False, r).total(3) for r in range(5)}
    assert memory.auto_retention(worlds, 3, Budget(10 * fits_with[4], "test"), False, 4) == 4
    assert memory.auto_retention(worlds, 3, Budget(fits_with[2], "test"), False, 4) == 2
    assert memory.auto_retention(worlds, 3, Budget(fits_with[1] - 1, "test"), False, 4) == 0


def test_full_size_self_forcing_keeps_its_sessions_on_an_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retained chunk of a full-size Wan world holds a decoder cache and a chunk of K/V: four of
    them would cost most of an H200's sessions, so the default gives way to --max-sessions."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (136 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    h200, worlds = device_budget("cuda"), self_forcing_size(torch.bfloat16)
    assert fit_sessions(worlds, 16, h200, True, "cuda", retention=4) < 16
    r = memory.auto_retention(worlds, 16, h200, True, 4)
    assert r < 4 and fit_sessions(worlds, 16, h200, True, "cuda", retention=r) == 16
