"""The original Wan DiT names (Wan2.1 / CausVid / Self-Forcing / Matrix-Game) -> diffusers names.

Read from diffusers' own converter (`convert_wan_transformer_to_diffusers`): the same renames,
written out key by key. The one trap: the original's `norm3` is the cross-attention norm (with
weight and bias) and `norm2` the weightless FFN norm; diffusers calls them `norm2` and `norm3`.
`norm1`, `norm2` and `head.norm` carry no weights, so only `norm3` appears in a checkpoint.
"""

from __future__ import annotations

from models.convert.keymap import KeyMap

_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k"}


def block_map(i: int, cross_attn_norm: bool = True) -> dict[str, str]:
    """Original -> diffusers names of one transformer block's weights."""
    out: dict[str, str] = {f"blocks.{i}.modulation": f"blocks.{i}.scale_shift_table"}
    for orig, ours in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        for name, dst in _ATTN.items():
            kinds = ("weight",) if name.startswith("norm") else ("weight", "bias")
            for kind in kinds:
                out[f"blocks.{i}.{orig}.{name}.{kind}"] = f"blocks.{i}.{ours}.{dst}.{kind}"
    for kind in ("weight", "bias"):
        out[f"blocks.{i}.ffn.0.{kind}"] = f"blocks.{i}.ffn.net.0.proj.{kind}"
        out[f"blocks.{i}.ffn.2.{kind}"] = f"blocks.{i}.ffn.net.2.{kind}"
        if cross_attn_norm:
            out[f"blocks.{i}.norm3.{kind}"] = f"blocks.{i}.norm2.{kind}"  # the swap
    return out


def dit_map(num_layers: int, *, text: bool, image: bool, cross_attn_norm: bool = True) -> KeyMap:
    """Original -> diffusers names of a whole Wan DiT (`text`: text_embedding; `image`: img_emb)."""
    out: dict[str, str] = {}
    linear = ("weight", "bias")
    for kind in linear:
        out[f"patch_embedding.{kind}"] = f"patch_embedding.{kind}"
        out[f"time_embedding.0.{kind}"] = f"condition_embedder.time_embedder.linear_1.{kind}"
        out[f"time_embedding.2.{kind}"] = f"condition_embedder.time_embedder.linear_2.{kind}"
        out[f"time_projection.1.{kind}"] = f"condition_embedder.time_proj.{kind}"
        out[f"head.head.{kind}"] = f"proj_out.{kind}"
        if text:
            out[f"text_embedding.0.{kind}"] = f"condition_embedder.text_embedder.linear_1.{kind}"
            out[f"text_embedding.2.{kind}"] = f"condition_embedder.text_embedder.linear_2.{kind}"
        if image:
            out[f"img_emb.proj.0.{kind}"] = f"condition_embedder.image_embedder.norm1.{kind}"
            out[f"img_emb.proj.1.{kind}"] = f"condition_embedder.image_embedder.ff.net.0.proj.{kind}"
            out[f"img_emb.proj.3.{kind}"] = f"condition_embedder.image_embedder.ff.net.2.{kind}"
            out[f"img_emb.proj.4.{kind}"] = f"condition_embedder.image_embedder.norm2.{kind}"
    out["head.modulation"] = "scale_shift_table"
    for i in range(num_layers):
        out |= block_map(i, cross_attn_norm)
    return KeyMap(out)


def prefixed(keymap: KeyMap, prefix: str) -> KeyMap:
    """The same map with `prefix` on every source key (the original wrappers' `model.`)."""
    return KeyMap(
        {prefix + k: v for k, v in keymap.rename.items()}, {prefix + k: v for k, v in keymap.ignored.items()}
    )
