"""The causal Wan DiT against diffusers' WanTransformer3DModel (same weights, fp32, CPU).

1. parity: one chunk, empty cache == diffusers' bidirectional forward on that chunk;
2. cache: chunk N through the KV cache == chunk-N rows of one dense diffusers forward over
   [chunks 1..N-1 clean, chunk N noisy] with per-token timesteps and a block-causal mask;
3. window: the same with a local window and sink frames (ring wraps, frames get evicted).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from models.causal_wan import CausalWan, CausalWanConfig, frame_attention_mask
from runtime.kv_cache import KVLayout
from tests.models.conftest import tiny_actions, tiny_config, tiny_mg_config

H = W = 8  # latent size -> 4x4 = 16 tokens per frame after 1x2x2 patches
TOL = 1e-5


class MaskedProcessor(WanAttnProcessor):
    """diffusers' processor with a fixed self-attention mask (diffusers' forward takes none)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def diffusers_twin(model: CausalWan) -> WanTransformer3DModel:
    ref = WanTransformer3DModel(**model.cfg.diffusers_config()).eval()
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref


def rollout(model: CausalWan, clean: list[torch.Tensor], noisy: torch.Tensor, t: float, text, actions=None):
    """Context passes over `clean` chunks, then denoise `noisy` through the cache."""
    cfg = model.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, model.tokens_per_frame(H, W))
    model.setup_caches(1, H, W, text_tokens=8)
    model.set_text(0, text)
    done = 0
    for _j, x in enumerate(clean):
        n = x.shape[2]
        act = None if actions is None else actions[:, done : done + n]
        model.forward_chunk(x, torch.zeros(1), index(model, layout, done, n), act, need_output=False)
        done += n
    n = noisy.shape[2]
    act = None if actions is None else actions[:, done : done + n]
    return model.forward_chunk(noisy, torch.tensor([t]), index(model, layout, done, n), act)


def index(model: CausalWan, layout: KVLayout, done: int, n: int, row: int = 0):
    """The one-entry ChunkIndex of row `row` after `done` committed frames."""
    return layout.index([row], [done], n, model.pool.pad_row)


def dense_reference(ref: WanTransformer3DModel, chunks, t: float, text, mask: torch.Tensor) -> torch.Tensor:
    """One diffusers forward over all chunks, last chunk at timestep t, the rest at 0."""
    x = torch.cat(chunks, dim=2)
    tpf = (H // 2) * (W // 2)
    n_last = chunks[-1].shape[2]
    ts = torch.zeros(1, x.shape[2] * tpf)
    ts[:, -n_last * tpf :] = t
    token_mask = mask.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)
    for blk in ref.blocks:
        blk.attn1.set_processor(MaskedProcessor(token_mask))
    out = ref(x, ts, text[None], return_dict=False)[0]
    return out[:, :, -n_last:]


@torch.no_grad()
def test_parity_one_chunk_matches_diffusers(make_model):
    model = make_model(tiny_config())
    ref = diffusers_twin(model)
    x = torch.randn(1, 4, 2, H, W)
    text = torch.randn(5, 8)
    expected = ref(x, torch.tensor([700.0]), text[None], return_dict=False)[0]
    got = rollout(model, [], x, 700.0, text)
    assert (got - expected).abs().max().item() <= TOL
    # and the dense path over the same single chunk
    dense = model.forward_dense(
        x, torch.full((1, 2), 700.0), [model.text_kv(text)], frame_attention_mask([2], 16)
    )
    assert (dense - expected).abs().max().item() <= TOL


@torch.no_grad()
@pytest.mark.parametrize("n_chunks", [2, 4])
def test_cache_matches_dense_block_causal(make_model, n_chunks):
    model = make_model(tiny_config(window_frames=16))
    ref = diffusers_twin(model)
    text = torch.randn(3, 8)
    chunks = [torch.randn(1, 4, 2, H, W) for _ in range(n_chunks)]
    got = rollout(model, chunks[:-1], chunks[-1], 500.0, text)
    mask = frame_attention_mask([2] * n_chunks, window_frames=16)
    expected = dense_reference(ref, chunks, 500.0, text, mask)
    assert (got - expected).abs().max().item() <= TOL
    # the mask really is block-causal: a different past changes the answer
    other = rollout(model, [torch.randn(1, 4, 2, H, W), *chunks[1:-1]], chunks[-1], 500.0, text)
    assert (other - got).abs().max().item() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize(
    ("window", "sinks", "sizes"), [(5, 1, [1, 2, 2, 2, 2, 2]), (4, 0, [2] * 6), (6, 2, [2] * 7)]
)
def test_window_and_sinks_match_dense_windowed_mask(make_model, window, sinks, sizes):
    model = make_model(tiny_config(window_frames=window, sink_frames=sinks))
    ref = diffusers_twin(model)
    text = torch.randn(2, 8)
    chunks = [torch.randn(1, 4, n, H, W) for n in sizes]
    got = rollout(model, chunks[:-1], chunks[-1], 250.0, text)
    mask = frame_attention_mask(sizes, window_frames=window, sink_frames=sinks)
    expected = dense_reference(ref, chunks, 250.0, text, mask)
    assert (got - expected).abs().max().item() <= TOL
    # the windowed rollout really differs from attending to everything
    full = dense_reference(
        diffusers_twin(model), chunks, 250.0, text, frame_attention_mask(sizes, sum(sizes))
    )
    assert (full - got).abs().max().item() > 1e-4


@torch.no_grad()
def test_cache_with_actions_matches_dense_forward(make_model):
    """With the action module (no diffusers twin), the cached rollout equals our dense forward."""
    cfg = tiny_config(window_frames=5, sink_frames=1, action=tiny_actions())
    model = make_model(cfg)
    sizes = [2, 2, 2, 2]
    text = torch.randn(2, 8)
    chunks = [torch.randn(1, 4, n, H, W) for n in sizes]
    actions = torch.randn(1, sum(sizes), 2, 3 + 2 + 2)
    got = rollout(model, chunks[:-1], chunks[-1], 400.0, text, actions)
    ts = torch.zeros(1, sum(sizes))
    ts[:, -2:] = 400.0
    mask = frame_attention_mask(sizes, 5, 1)
    dense = model.forward_dense(torch.cat(chunks, 2), ts, [model.text_kv(text)], mask, actions)
    assert (got - dense[:, :, -2:]).abs().max().item() <= TOL
    # actions change the prediction, and so do earlier frames' actions (temporal attention)
    other = actions.clone()
    other[:, -1] += 1.0
    assert (rollout(model, chunks[:-1], chunks[-1], 400.0, text, other) - got).abs().max().item() > 1e-4
    past = actions.clone()
    past[:, 4] += 1.0
    assert (rollout(model, chunks[:-1], chunks[-1], 400.0, text, past) - got).abs().max().item() > 1e-4


@torch.no_grad()
def test_denoise_never_writes_committed_slots(make_model):
    model = make_model(tiny_config(window_frames=4, sink_frames=1))
    layout = KVLayout(1, 4, model.tokens_per_frame(H, W))
    model.setup_caches(1, H, W, text_tokens=1)
    model.set_text(0, torch.zeros(1, 8))
    done = 0
    for n in [1, 2, 2, 2]:
        model.forward_chunk(torch.randn(1, 4, n, H, W), torch.zeros(1), index(model, layout, done, n))
        done += n
    before = layout.committed_view(model.pool, 0, done, 2)
    for t in (1000.0, 500.0):
        model.forward_chunk(torch.randn(1, 4, 2, H, W), torch.tensor([t]), index(model, layout, done, 2))
    after = layout.committed_view(model.pool, 0, done, 2)
    for name in before:
        assert torch.equal(before[name], after[name])


def test_config_round_trips_and_rejects_unsupported():
    cfg = tiny_config(action=tiny_actions())
    assert CausalWanConfig.from_dict(cfg.to_dict()) == cfg
    assert CausalWanConfig.from_dict({**cfg.diffusers_config(), "image_dim": 1280}).image_dim == 1280
    with pytest.raises(ValueError, match="I2V"):
        CausalWanConfig.from_dict({**cfg.diffusers_config(), "image_dim": 1280, "added_kv_proj_dim": 64})
    with pytest.raises(ValueError, match="patch_size"):
        CausalWan(tiny_config(patch_size=(2, 2, 2)))


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_config(sink_frames=1, window_frames=5),
        tiny_config(action=tiny_actions()),  # mouse + vector: temporal K/V in the cache too
        tiny_config(action=tiny_actions(mouse=False, vector_dim=0)),  # keys only: no temporal K/V
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_formula_matches_the_allocated_pool_row(cfg: CausalWanConfig, dtype: torch.dtype):
    model = CausalWan(cfg)
    h, w = 6, 8  # latent size
    pool = model.setup_caches(3, h, w, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert cfg.kv_bytes(cfg.tokens_per_frame(h, w), itemsize) == pool.row_nbytes() > 0
    assert pool.nbytes() == 4 * pool.row_nbytes()  # 3 session rows + the padding row
    assert not any(k.startswith("pool") for k in model.state_dict())  # weights only


@torch.no_grad()
def test_matrix_game_cache_matches_dense_forward(make_model):
    """The pooled Matrix-Game path (conditioning from the row, action windows from the row's ring,
    mouse and keyboard K/V in the pool, eviction) equals the dense forward over the whole clip."""
    model = make_model(tiny_mg_config())
    sizes = [2, 2, 2, 2]
    tokens = torch.randn(3, 16)
    cond = torch.randn(4, sum(sizes), H, W)
    chunks = [torch.randn(1, 4, n, H, W) for n in sizes]
    actions = torch.randn(1, sum(sizes), 4, 3 + 2)
    actions[..., :3] = (actions[..., :3] > 0).float()

    def cached(acts):
        model.setup_caches(1, H, W)
        model.set_text(0, tokens)
        model.set_image_cond(0, cond)
        return rollout_no_setup(model, chunks, acts)

    got = cached(actions)
    ts = torch.zeros(1, sum(sizes))
    ts[:, -2:] = 400.0
    mask = frame_attention_mask(sizes, 5, 0)
    x = torch.cat([torch.cat(chunks, 2), cond[None]], dim=1)
    dense = model.forward_dense(x, ts, [model.text_kv(tokens)], mask, actions)
    assert (got - dense[:, :, -2:]).abs().max().item() <= TOL
    # the chunk's own actions matter, and so do earlier chunks' (their windows and cached action K/V)
    for frame, col in ((7, 0), (4, 3), (3, 1)):
        other = actions.clone()
        other[:, frame, :, col] += 1.0
        assert (cached(other) - got).abs().max().item() > 1e-4, (frame, col)
    # the last raw frame of the last latent frame is outside every window (as in the original)
    other = actions.clone()
    other[:, -1, -1] += 1.0
    assert (cached(other) - got).abs().max().item() == 0.0


def rollout_no_setup(model: CausalWan, chunks: list[torch.Tensor], actions: torch.Tensor) -> torch.Tensor:
    """Context passes over all chunks but the last, then the last at t=400 (pool already set up)."""
    cfg = model.cfg
    layout = KVLayout(cfg.sink_frames, cfg.window_frames, model.tokens_per_frame(H, W))
    done = 0
    for x in chunks[:-1]:
        n = x.shape[2]
        model.forward_chunk(
            x, torch.zeros(1), index(model, layout, done, n), actions[:, done : done + n], False
        )
        done += n
    n = chunks[-1].shape[2]
    return model.forward_chunk(
        chunks[-1], torch.tensor([400.0]), index(model, layout, done, n), actions[:, done : done + n]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_formula_matches_the_matrix_game_pool_row(dtype: torch.dtype):
    cfg = tiny_mg_config()
    pool = CausalWan(cfg).setup_caches(2, 6, 8, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert cfg.kv_bytes(cfg.tokens_per_frame(6, 8), itemsize) == pool.row_nbytes()
    assert pool.ak.shape[0] == 1  # the mouse's per-token K/V of the one action block
    assert pool.kb_k.shape == (1, 3, 1, 5, 2, 64)  # the keyboard's: one token per frame slot
