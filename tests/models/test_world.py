"""World: device-independent noise, and the compiled chunk forwards (inductor on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from models.registry import build_world, tiny_random_configs
from models.world import Conditioning, World, WorldConfig
from runtime.kv_cache import KVLayout


def test_noise_is_drawn_on_the_cpu_from_seed_chunk_and_step():
    world = build_world(*tiny_random_configs(), seed=0)
    a = world.noise(5, 2, 1, 2)
    assert torch.equal(a, world.noise(5, 2, 1, 2))
    assert not torch.equal(a, world.noise(5, 2, 2, 2)) and not torch.equal(a, world.noise(5, 3, 1, 2))
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(a, world.noise(5, 2, 1, 2))


def test_a_leased_row_starts_clear_of_what_its_last_owner_left():
    """A state dropped mid-chunk (an exception inside the forward) may leave NaN K/V anywhere in
    its row; masked slots still meet them in attention's products, so a new lease zeroes the row."""
    world = build_world(*tiny_random_configs(), seed=0)
    world.setup(2)
    old = world.init_state(Conditioning(seed=1))
    for b in world.transformer.pool.row_view(old.row).values():
        b.fill_(float("nan"))
    world.release_state(old)
    new = world.init_state(Conditioning(seed=2))
    assert new.row == old.row
    view = world.transformer.pool.row_view(new.row)
    assert all(torch.isfinite(b).all() for b in view.values())
    assert all(not b.any() for name, b in view.items() if name not in ("tk", "tv"))


def run_chunk(world: World, layout: KVLayout, live: dict[int, list], step: int) -> torch.Tensor:
    """One denoise + context chunk for every live session (row -> [state, committed frames])."""
    rows = sorted(live)
    n = world.chunk_frames
    b = world.bucket(len(rows)) or len(rows)
    index = layout.index(rows, [live[r][1] for r in rows], n, world.pad_row, bucket=b)
    c, h, w = world.latent_shape
    pad = [torch.zeros(c, n, h, w)] * (b - len(rows))
    x = torch.stack([world.noise(live[r][0].seed, step, 0, n) for r in rows] + pad)
    acts = torch.zeros(b, n, 2, 5 + 2 + 2)
    acts[:, :, :, step % 5] = 1.0
    t = world.config.schedule.timesteps[step % 4]
    pred = world.denoise(x, t, index, acts)
    world.context(pred, index, acts)
    for r in rows:
        live[r][1] += n
    return pred[: len(rows)]


@pytest.mark.slow
@pytest.mark.parametrize("slack", [0, 2])  # 2: the ring of the pipelined decode
@torch.no_grad()
def test_compiled_chunks_have_one_graph_per_bucket_and_match_eager(slack):
    """fullgraph compile, buckets (1, 2, 4): 40 chunks while sessions join and leave and windows
    fill and wrap; no graph break, no recompile after each bucket's first use, compiled == eager."""
    eager = build_world(*tiny_random_configs(), seed=0)
    compiled = build_world(*tiny_random_configs(), seed=0)
    for w in (eager, compiled):
        w.setup(4, slack_frames=slack)
    compiled.compile(buckets=(1, 2, 4))
    layout = KVLayout(1, 6, eager.tokens_per_frame, slack)
    # sessions alive at each chunk: join and leave, every bucket in use, windows wrap (6 frames)
    plan = [[0], [0, 1], [0, 1, 2], [1, 2], [1, 2, 3, 4], [2, 4], [4], [4, 5, 6]] * 5
    lives: list[dict[int, list]] = [{}, {}]
    sids: list[dict[int, int]] = [{}, {}]  # session id -> row, per world
    counters.clear()
    worst = 0.0
    for step, alive in enumerate(plan):
        for w, live, rows in zip((eager, compiled), lives, sids, strict=True):
            for sid in [s for s in rows if s not in alive]:
                w.release_state(live.pop(rows.pop(sid))[0])
            for sid in [s for s in alive if s not in rows]:
                st = w.init_state(Conditioning(seed=sid))
                rows[sid] = st.row
                live[st.row] = [st, 0]
        a = run_chunk(eager, layout, lives[0], step)
        b = run_chunk(compiled, layout, lives[1], step)
        worst = max(worst, (a - b).abs().max().item())
    assert max(v[1] for v in lives[1].values()) > 6  # the ring wrapped
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2 * 3  # denoise and context, per bucket, once
    assert worst <= 1e-3, worst


def test_a_world_config_with_settings_of_no_world_names_them():
    """The flat layout before the plug-in block: its tiny-world keys are refused by name."""
    good = WorldConfig(id="w", fps=8.0, width=32, height=32)
    assert WorldConfig.from_dict(good.to_dict()) == good
    with pytest.raises(ValueError, match=r"\['atlas_tiles', 'carry_channels'\].*\"plugin\" block"):
        WorldConfig.from_dict({**good.to_dict(), "carry_channels": [8], "atlas_tiles": 64})
