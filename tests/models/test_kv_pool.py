"""The static K/V pool: one batched forward equals each session run alone, and the hot path
never reads a device value on the host."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.causal_wan import CausalWan
from models.kv_pool import PoolAttention
from models.registry import build_world, from_name, tiny_random_configs
from models.world import Conditioning
from runtime.engine import Engine
from runtime.kv_cache import KVLayout
from tests.models.conftest import tiny_actions, tiny_config
from tests.runtime.conftest import committed, keys

H = W = 8  # latent size: 16 tokens per frame
TOL = 2e-5  # fp32 CPU: the batched call only changes summation order and adds masked-out keys


def build_history(model: CausalWan, layout: KVLayout, row: int, chunks: int, text_len: int, gen) -> int:
    """Context passes of `chunks` random clean chunks into `row`, alone; returns the committed frames."""
    model.set_text(row, torch.randn(text_len, 8, generator=gen))
    done = 0
    for _ in range(chunks):
        x = torch.randn(1, 4, 2, H, W, generator=gen)
        act = torch.randn(1, 2, 2, 7, generator=gen)
        model.forward_chunk(
            x, torch.zeros(1), layout.index([row], [done], 2, model.pool.pad_row), act, need_output=False
        )
        done += 2
    return done


@torch.no_grad()
@pytest.mark.parametrize("sessions", [1, 2, 3, 5, 8])
def test_batched_forward_equals_each_session_alone(make_model, sessions):
    """Rows at different fill levels (empty, filling, ring wrapped past the window), sinks on,
    different text lengths, rows out of order, padded to a bucket of 8."""
    cfg = tiny_config(window_frames=5, sink_frames=1, action=tiny_actions())
    model = make_model(cfg)
    layout = KVLayout(1, 5, model.tokens_per_frame(H, W))
    model.setup_caches(8, H, W, text_tokens=4)
    gen = torch.Generator().manual_seed(sessions)
    rows = list(reversed(range(sessions)))
    fills = [0, 4, 1, 6, 2, 5, 3, 7]  # chunks of history per entry: empty, filling, wrapped (> 3)
    done = [build_history(model, layout, r, fills[i], 1 + i % 4, gen) for i, r in enumerate(rows)]
    x = torch.randn(sessions, 4, 2, H, W, generator=gen)
    t = torch.rand(sessions, generator=gen) * 1000
    act = torch.randn(sessions, 2, 2, 7, generator=gen)
    solo = [
        model.forward_chunk(x[i : i + 1], t[i : i + 1], layout.index([r], [done[i]], 2, 8), act[i : i + 1])
        for i, r in enumerate(rows)
    ]
    pad = 8 - sessions
    xb = torch.cat([x, torch.zeros(pad, 4, 2, H, W)])
    tb = torch.cat([t, torch.zeros(pad)])
    ab = torch.cat([act, torch.zeros(pad, 2, 2, 7)])
    batched = model.forward_chunk(xb, tb, layout.index(rows, done, 2, 8, bucket=8), ab)
    for i in range(sessions):
        assert (batched[i] - solo[i][0]).abs().max().item() <= TOL, i
    # and each row's answer depends on its own history: rows really are separate
    if sessions > 1:
        assert (solo[0][0] - solo[1][0]).abs().max().item() > 1e-3


def test_fork_copies_a_row_and_release_frees_it():
    world = build_world(*tiny_random_configs(), seed=0)
    world.setup(2)
    a = world.init_state(Conditioning(seed=1))
    pool = world.transformer.pool
    pool.k[:, a.row] = 3.0
    b = world.fork_state(a)
    assert b.row != a.row and torch.equal(pool.k[:, b.row], pool.k[:, a.row])
    with pytest.raises(Exception, match="rows"):
        world.init_state(Conditioning(seed=2))
    world.release_state(a)
    c = world.init_state(Conditioning(seed=2))
    assert c.row == a.row
    world.release_state(a)  # a stale holder never frees the row its successor holds
    assert world.free_rows == 0
    row_of_b = b.row
    del b  # dropped without release: its row stays held (rows come back only by release_state)
    gc.collect()
    with pytest.raises(Exception, match="rows"):
        world.init_state(Conditioning(seed=3))
    world._free_row(row_of_b, pool.owner[row_of_b])
    d = world.init_state(Conditioning(seed=3))
    world.setup(4)  # growing keeps live rows
    assert torch.equal(pool.k[:, 0], world.transformer.pool.k[:, 0]) and world.free_rows == 2
    assert {c.row, d.row} == {0, 1}


def test_resizing_moves_live_rows_down_and_keeps_other_holders_rows():
    world = build_world(*tiny_random_configs(), seed=0)
    world.resize(4, 0)
    states = [world.init_state(Conditioning(seed=s)) for s in range(4)]
    pool = world.transformer.pool
    for s in states:
        pool.k[:, s.row] = float(s.seed)
    for s in states[:2]:
        world.release_state(s)
    mine, other = states[3], states[2]  # rows 3 and 2; `other` belongs to another holder
    world.resize(1, 0, live=[mine])  # one row for mine, on top of the row the other holds
    pool = world.transformer.pool
    assert pool.rows == 3  # row 2 stays where it is, so the pool keeps it
    assert mine.row == 0 and other.row == 2 and pool.owner == {0: mine.lease, 2: other.lease}
    assert torch.equal(pool.k[:, mine.row], torch.full_like(pool.k[:, 0], 3.0))
    assert torch.equal(pool.k[:, other.row], torch.full_like(pool.k[:, 0], 2.0))


class HostSyncError(AssertionError):
    """A device value was read on the host inside the hot path."""


class NoHostSync(TorchFunctionMode):
    """Fails on `.item()`, `.cpu()`, `.tolist()`, `.numpy()` and tensor truthiness."""

    BANNED = frozenset({"item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.BANNED:
            raise HostSyncError(f"{func.__name__} inside the chunk forward")
        return func(*args, **(kwargs or {}))


class NoScalarRead(TorchDispatchMode):
    """Fails on the aten op every host read of a tensor value ends in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostSyncError("a tensor value was read on the host")
        return func(*args, **(kwargs or {}))


def test_guard_catches_host_reads():
    with pytest.raises(HostSyncError), NoHostSync():
        bool(torch.ones(1) > 0)
    with pytest.raises(HostSyncError), NoScalarRead():
        torch.ones(1).sum().item()


@torch.no_grad()
def test_denoise_and_context_never_sync_with_the_host():
    world = build_world(*tiny_random_configs(), seed=0)
    world.setup(4)
    states = [world.init_state(Conditioning(seed=s)) for s in range(3)]
    layout = KVLayout(1, 6, world.tokens_per_frame)
    n = world.chunk_frames
    index = layout.index([s.row for s in states], [0, 4, 10], n, world.pad_row, bucket=4)
    x = torch.stack([world.noise(s.seed, 1, 0, n) for s in states] + [torch.zeros(8, n, 16, 16)])
    acts = torch.zeros(4, n, 2, 5 + 2 + 2)
    with NoHostSync(), NoScalarRead():
        pred = world.denoise(x, 900.0, index, acts)
        world.context(pred, index, acts)
    assert pred.shape == x.shape and torch.isfinite(pred).all()


def test_a_prompt_longer_than_the_rows_text_slots_is_refused():
    from models.world import ConditioningError

    world = build_world(*tiny_random_configs(), seed=0)
    world.setup(2)
    cfg = world.transformer.cfg
    assert cfg.text_tokens == cfg.null_text_len  # no prompts configured: no unused text slots
    with pytest.raises(ConditioningError) as err:
        world.init_state(Conditioning(text=torch.zeros(cfg.text_tokens + 1, cfg.text_dim)))
    assert err.value.field == "prompt" and world.free_rows == world.max_sessions  # no row kept


@torch.no_grad()
def test_matrix_game_batch_equals_each_session_alone_without_host_sync(make_model):
    """Matrix-Game rows (own conditioning, own action ring, mouse + keyboard K/V) at different
    fill levels, batched and padded to a bucket, equal each row run alone; no host reads."""
    from tests.models.conftest import tiny_mg_config

    model = make_model(tiny_mg_config())
    layout = KVLayout(0, 5, model.tokens_per_frame(H, W))
    model.setup_caches(4, H, W)
    gen = torch.Generator().manual_seed(0)
    rows, fills = [2, 0, 1], [3, 0, 1]  # chunks of history: wrapped, empty, filling
    done = []
    for row, fill in zip(rows, fills, strict=True):
        model.set_text(row, torch.randn(3, 16, generator=gen))
        model.set_image_cond(row, torch.randn(4, 8, H, W, generator=gen))
        for c in range(fill):
            x = torch.randn(1, 4, 2, H, W, generator=gen)
            act = torch.randn(1, 2, 4, 5, generator=gen)
            model.forward_chunk(x, torch.zeros(1), layout.index([row], [2 * c], 2, 4), act, need_output=False)
        done.append(2 * fill)
    x = torch.randn(3, 4, 2, H, W, generator=gen)
    t = torch.rand(3, generator=gen) * 1000
    act = torch.randn(3, 2, 4, 5, generator=gen)
    solo = [
        model.forward_chunk(x[i : i + 1], t[i : i + 1], layout.index([r], [done[i]], 2, 4), act[i : i + 1])
        for i, r in enumerate(rows)
    ]
    index = layout.index(rows, done, 2, 4, bucket=4)
    xb, tb, ab = torch.cat([x, x[:1] * 0]), torch.cat([t, t[:1] * 0]), torch.cat([act, act[:1] * 0])
    with NoHostSync(), NoScalarRead():
        batched = model.forward_chunk(xb, tb, index, ab)
    for i in range(3):
        assert (batched[i] - solo[i][0]).abs().max().item() <= TOL, i


@torch.no_grad()
def test_a_one_token_text_is_read_as_its_value(monkeypatch):
    """Rows holding one text token skip the cross-attention's query and SDPA (softmax over one
    key weighs it 1): the tiny world's frames are the same bits either way."""
    read_v = PoolAttention.one_text_value
    reads: list[bool] = []

    def counted(self, layer):
        v = read_v(self, layer)
        reads.append(v is not None)
        return v

    def play() -> list:
        engine = Engine({"m": from_name("tiny-world")})
        engine.add_stream("s", "m", Conditioning(seed=3))
        return [committed(engine, "s", keys(k)).frames for k in "ddss"]

    monkeypatch.setattr(PoolAttention, "one_text_value", counted)
    short = play()
    assert reads and all(reads)  # every block of every forward took the value
    monkeypatch.setattr(PoolAttention, "one_text_value", lambda self, layer: None)
    full = play()
    assert all(np.array_equal(a, b) for a, b in zip(short, full, strict=True))


class PoolReads(TorchDispatchMode):
    """Bytes that copying ops (gather, index, clone, cast, concatenation) read from the pool's
    storage; and the key length of every SDPA call whose K is a view of the pool."""

    COPIES = frozenset(
        {"index_select", "gather", "index", "take", "clone", "_to_copy", "cat", "stack", "copy_"}
    )

    def __init__(self, pool) -> None:
        super().__init__()
        self.storages = {b.untyped_storage().data_ptr() for b in pool.buffers()}
        self.copied = 0
        self.key_lengths: list[int] = []  # (sdpa calls with K in the pool)

    def _in_pool(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        srcs = args[1:] if name == "copy_" else args  # copy_ into the pool is a write
        flat = [t for a in srcs for t in (a if isinstance(a, (list, tuple)) else [a])]
        if name in self.COPIES:
            self.copied += sum(t.numel() * t.element_size() for t in flat if self._in_pool(t))
        if "scaled_dot_product" in name and self._in_pool(args[1]):
            self.key_lengths.append(args[1].shape[-2])
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_forward_reads_rows_in_place_and_only_their_filled_part(make_model, monkeypatch):
    """Eager: no K/V byte of the pool (self, action, text) is gathered or copied; entries on
    consecutive rows read one view cut at their longest filled prefix (shorter ones masked), an
    entry on a row of its own its own prefix. The compiled layout (gather under a mask, forced
    here) copies whole rows, which the count sees."""
    cfg = tiny_config(window_frames=5, sink_frames=1, action=tiny_actions(), attention_head_dim=16)
    model = make_model(cfg)
    t = model.tokens_per_frame(H, W)
    layout = KVLayout(1, 5, t)
    model.setup_caches(6, H, W, text_tokens=4)
    gen = torch.Generator().manual_seed(0)
    rows, fills = [4, 1, 0, 2], [0, 1, 0, 4]  # chunks of history: empty, filling, empty, wrapped
    done = [build_history(model, layout, r, f, 3, gen) for r, f in zip(rows, fills, strict=True)]
    index = layout.index(rows, done, 2, model.pool.pad_row, bucket=5)
    x, act = torch.randn(5, 4, 2, H, W, generator=gen), torch.randn(5, 2, 2, 7, generator=gen)
    reads = PoolReads(model.pool)
    with reads:
        out = model.forward_chunk(x, torch.zeros(5), index, act)
    assert reads.copied == 0
    # per layer, runs in row order: rows 0-2 (2, 4 and all 6 frames: 6), row 4 (2), the pad row
    # 6 (2); their text (3, 3, 1); in block 0 the action module's frames
    frames = [6, 2, 2]
    per_layer = [f * t for f in frames] + [3, 3, 1]
    assert reads.key_lengths == per_layer + frames + per_layer * (cfg.num_layers - 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    gathered = PoolReads(model.pool)
    with gathered:
        again = model.forward_chunk(x, torch.zeros(5), index, act)
    assert gathered.copied >= 5 * model.pool.row_nbytes() // 2  # at least every row's K/V, once
    assert (out - again).abs().max().item() <= TOL
