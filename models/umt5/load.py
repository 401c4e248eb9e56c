"""Load a UMT5 encoder and its tokenizer from a local directory (never from a hub).

Two layouts, told apart by what the directory holds:

* Wan's original release (e.g. a Wan2.1-T2V-1.3B download): `models_t5_umt5-xxl-enc-bf16.pth`
  (a state dict of Wan's `T5Encoder`) and the tokenizer in `google/umt5-xxl/tokenizer.json`;
* a diffusers Wan repository: `text_encoder/` (transformers' `UMT5EncoderModel`: config.json and
  one or more *.safetensors) and `tokenizer/tokenizer.json`.

Shapes come from the weights (and config.json where there is one); every key is mapped
explicitly and checked (`models.convert.keymap`): a missing, unexpected or mis-shaped tensor is a
`ConversionError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from models.convert.keymap import KeyMap, apply, module_shapes
from models.umt5.model import UMT5Config, UMT5Encoder
from models.umt5.tokenizer import PromptTokenizer

ORIGINAL_WEIGHTS = "models_t5_umt5-xxl-enc-bf16.pth"
TOKENIZER_PLACES = ("tokenizer/tokenizer.json", "google/umt5-xxl/tokenizer.json", "tokenizer.json")
ORIGINAL_MAX_DISTANCE = 128  # fixed in Wan's T5RelativeEmbedding
ORIGINAL_EPS = 1e-6  # fixed in Wan's T5LayerNorm


def original_keymap(layers: int) -> KeyMap:
    """Wan's `T5Encoder` state dict (shared_pos=False: a position bias in every block) -> ours."""
    rename = {"token_embedding.weight": "tok_emb.weight", "norm.weight": "norm.weight"}
    for i in range(layers):
        src, dst = f"blocks.{i}.", f"blocks.{i}."
        rename |= {
            src + "norm1.weight": dst + "attn_norm.weight",
            src + "attn.q.weight": dst + "attn.q.weight",
            src + "attn.k.weight": dst + "attn.k.weight",
            src + "attn.v.weight": dst + "attn.v.weight",
            src + "attn.o.weight": dst + "attn.o.weight",
            src + "pos_embedding.embedding.weight": dst + "attn.rel_bias.weight",
            src + "norm2.weight": dst + "ffn_norm.weight",
            src + "ffn.gate.0.weight": dst + "ffn.w1.weight",
            src + "ffn.fc1.weight": dst + "ffn.w3.weight",
            src + "ffn.fc2.weight": dst + "ffn.w2.weight",
        }
    return KeyMap(rename)


def diffusers_keymap(layers: int) -> KeyMap:
    """transformers' `UMT5EncoderModel` safetensors names -> ours."""
    rename = {"shared.weight": "tok_emb.weight", "encoder.final_layer_norm.weight": "norm.weight"}
    ignored = {"encoder.embed_tokens.weight": "tied to shared.weight (the same embedding)"}
    for i in range(layers):
        attn, ffn, dst = f"encoder.block.{i}.layer.0.", f"encoder.block.{i}.layer.1.", f"blocks.{i}."
        rename |= {
            attn + "layer_norm.weight": dst + "attn_norm.weight",
            attn + "SelfAttention.q.weight": dst + "attn.q.weight",
            attn + "SelfAttention.k.weight": dst + "attn.k.weight",
            attn + "SelfAttention.v.weight": dst + "attn.v.weight",
            attn + "SelfAttention.o.weight": dst + "attn.o.weight",
            attn + "SelfAttention.relative_attention_bias.weight": dst + "attn.rel_bias.weight",
            ffn + "layer_norm.weight": dst + "ffn_norm.weight",
            ffn + "DenseReluDense.wi_0.weight": dst + "ffn.w1.weight",
            ffn + "DenseReluDense.wi_1.weight": dst + "ffn.w3.weight",
            ffn + "DenseReluDense.wo.weight": dst + "ffn.w2.weight",
        }
    return KeyMap(rename, ignored)


def _count_layers(keys: Mapping[str, object], prefix: str, suffix: str) -> int:
    return sum(1 for k in keys if k.startswith(prefix) and k.endswith(suffix))


def config_from_original(state: Mapping[str, torch.Tensor], text_len: int) -> UMT5Config:
    """The shapes of a Wan `T5Encoder` state dict."""
    vocab, dim = state["token_embedding.weight"].shape
    buckets, heads = state["blocks.0.pos_embedding.embedding.weight"].shape
    return UMT5Config(
        vocab=vocab,
        dim=dim,
        heads=heads,
        head_dim=state["blocks.0.attn.q.weight"].shape[0] // heads,
        ffn=state["blocks.0.ffn.fc1.weight"].shape[0],
        layers=_count_layers(state, "blocks.", ".norm1.weight"),
        buckets=buckets,
        max_distance=ORIGINAL_MAX_DISTANCE,
        eps=ORIGINAL_EPS,
        text_len=text_len,
    )


def config_from_diffusers(config: Mapping[str, object], text_len: int) -> UMT5Config:
    """transformers' UMT5 config.json -> ours (only the gated-GELU encoder Wan uses)."""
    proj = config.get("feed_forward_proj", "gated-gelu")
    if proj != "gated-gelu":
        raise ValueError(f"text_encoder/config.json: feed_forward_proj {proj!r}, Wan's UMT5 is gated-gelu")
    return UMT5Config(
        vocab=int(config["vocab_size"]),
        dim=int(config["d_model"]),
        heads=int(config["num_heads"]),
        head_dim=int(config["d_kv"]),
        ffn=int(config["d_ff"]),
        layers=int(config["num_layers"]),
        buckets=int(config["relative_attention_num_buckets"]),
        max_distance=int(config.get("relative_attention_max_distance", ORIGINAL_MAX_DISTANCE)),
        eps=float(config.get("layer_norm_epsilon", ORIGINAL_EPS)),
        text_len=text_len,
    )


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as s:
            for k in s.keys():  # noqa: SIM118 - safe_open has no __iter__
                state[k] = s.get_tensor(k)
    return state


def build(
    cfg: UMT5Config, state: Mapping[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
) -> UMT5Encoder:
    """An encoder holding `state` (our names, checked against the model's own) on device in dtype."""
    with torch.device("meta"):
        model = UMT5Encoder(cfg)
    target = module_shapes(model)
    same = KeyMap({k: k for k in target})
    weights = apply(state, same, target, "UMT5 encoder")
    model.load_state_dict({k: v.to(device, dtype) for k, v in weights.items()}, assign=True)
    return model.eval().requires_grad_(False)


def find_tokenizer(root: Path) -> Path:
    """The tokenizer.json of a Wan or diffusers directory."""
    for place in TOKENIZER_PLACES:
        if (root / place).is_file():
            return root / place
    raise FileNotFoundError(f"{root}: no tokenizer.json (looked in {', '.join(TOKENIZER_PLACES)})")


def load_weights(root: Path, text_len: int) -> tuple[UMT5Config, dict[str, torch.Tensor]]:
    """Config and our-named weights from either layout (see the module docstring)."""
    if (root / ORIGINAL_WEIGHTS).is_file():
        state = torch.load(root / ORIGINAL_WEIGHTS, map_location="cpu", mmap=True, weights_only=True)
        cfg = config_from_original(state, text_len)
        keymap = original_keymap(cfg.layers)
    elif (root / "text_encoder").is_dir():
        config_path = root / "text_encoder" / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: missing")
        cfg = config_from_diffusers(json.loads(config_path.read_text()), text_len)
        state = _safetensors(root / "text_encoder")
        if "shared.weight" not in state and "encoder.embed_tokens.weight" in state:
            state["shared.weight"] = state.pop("encoder.embed_tokens.weight")
        keymap = diffusers_keymap(cfg.layers)
    else:
        raise FileNotFoundError(f"{root}: neither {ORIGINAL_WEIGHTS} nor a diffusers text_encoder/ directory")
    with torch.device("meta"):
        target = module_shapes(UMT5Encoder(cfg))
    return cfg, apply(state, keymap, target, f"UMT5 encoder in {root}")


class TextEncoder:
    """Tokenizer + UMT5 encoder on one device: prompt -> (tokens, dim) float32 hidden states."""

    def __init__(self, model: UMT5Encoder, tokenizer: PromptTokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        self.device = model.tok_emb.weight.device

    def ids(self, prompt: str, limit: int | None = None) -> list[int]:
        """Token ids of `prompt`; PromptTooLong past `limit` (default: the encoder's text_len)."""
        return self.tokenizer.checked_ids(prompt, min(limit or self.cfg.text_len, self.cfg.text_len))

    @torch.inference_mode()
    def encode_ids(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), dim) float32 on the CPU. Only the prompt's own tokens go through the model:
        the original pads to 512 with masked keys, which leaves these rows as they are."""
        batch = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(batch)[0].float().cpu()

    def encode(self, prompt: str, limit: int | None = None) -> torch.Tensor:
        """`encode_ids(ids(prompt, limit))`."""
        return self.encode_ids(self.ids(prompt, limit))


def load_text_encoder(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_len: int = 512,
) -> TextEncoder:
    """The encoder and tokenizer in the local directory `path` (either layout)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"text encoder {root}: not a directory")
    tokenizer = PromptTokenizer(find_tokenizer(root))
    cfg, state = load_weights(root, text_len)
    return TextEncoder(build(cfg, state, device, dtype), tokenizer)
