"""Prompt text -> text embeddings without a network: a directory of precomputed embeddings.

`worldserve serve --prompt-embeds DIR` resolves `open.prompt` / `reset.prompt` /
`generate.prompt` here. DIR holds one safetensors file per prompt::

    DIR/<sha256 of the prompt's UTF-8 bytes, 64 hex digits>.safetensors
    DIR/index.json          (optional) {"prompt text": "file.safetensors", ...}

Each file holds one tensor `prompt_embeds`, (L, text_dim) or (1, L, text_dim), any float dtype:
the text encoder's output rows for the prompt's tokens (UMT5-XXL for Self-Forcing: L <= 512,
text_dim 4096). Rows past the prompt may be zeros or absent; the world pads with zero rows to
its text length (Self-Forcing attends to all 512, as the original does). Optional metadata
`prompt` (the text) is checked against the requested prompt when present, so a misnamed file
is refused rather than silently used. `index.json` entries win over hash names.

Lookups are files on local disk; a small LRU (`CACHE_ENTRIES`) keeps recently used prompts.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

TENSOR = "prompt_embeds"
INDEX = "index.json"
CACHE_ENTRIES = 8  # resolved prompts kept in memory (8 x 512 x 4096 x 4 B = 64 MiB at full size)


class PromptError(ValueError):
    """The prompt cannot be turned into an embedding here (unknown prompt, bad file)."""


def prompt_key(prompt: str) -> str:
    """The file stem of a prompt: sha256 of its UTF-8 bytes, lower-case hex."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def save_prompt_embeds(directory: str | Path, prompt: str, embeds: torch.Tensor) -> Path:
    """Write one prompt's embeddings (L, text_dim) as DIR/<sha256>.safetensors (the format above)."""
    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2:
        raise ValueError(f"prompt embeddings must be (L, text_dim), got {tuple(embeds.shape)}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{prompt_key(prompt)}.safetensors"
    save_file({TENSOR: embeds.contiguous()}, str(path), metadata={"prompt": prompt})
    return path


class PromptEmbeddings:
    """Precomputed prompt embeddings in a local directory (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        if not self.root.is_dir():
            raise FileNotFoundError(f"--prompt-embeds {self.root}: not a directory")
        self.index: dict[str, str] = {}
        index = self.root / INDEX
        if index.is_file():
            try:
                data = json.loads(index.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{index}: {exc}") from exc
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError(f"{index}: expected an object of prompt -> file name")
            self.index = data
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def path(self, prompt: str) -> Path | None:
        """The file holding `prompt`'s embeddings, or None when there is none."""
        name = self.index.get(prompt)
        candidates = [self.root / name] if name is not None else []
        candidates.append(self.root / f"{prompt_key(prompt)}.safetensors")
        for p in candidates:
            if p.is_file() and p.resolve().is_relative_to(self.root.resolve()):
                return p
        return None

    def problem(self, prompt: str) -> str | None:
        """Why `prompt` cannot be resolved (None: it can), without reading the tensor."""
        if self.path(prompt) is None:
            return (
                f"no precomputed embedding for this prompt in {self.root.name}/ "
                f"(expected {prompt_key(prompt)}.safetensors or an {INDEX} entry)"
            )
        return None

    def embed(self, prompt: str) -> torch.Tensor:
        """(L, text_dim) float32 embeddings of `prompt`; raises PromptError."""
        hit = self._cache.get(prompt)
        if hit is not None:
            self._cache.move_to_end(prompt)
            return hit
        path = self.path(prompt)
        if path is None:
            raise PromptError(self.problem(prompt) or "unknown prompt")
        try:
            with safe_open(str(path), "pt") as f:
                stored = (f.metadata() or {}).get("prompt")
                if TENSOR not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise PromptError(f"{path.name} has no {TENSOR!r} tensor")
                embeds = f.get_tensor(TENSOR)
        except (OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, PromptError):
                raise
            raise PromptError(f"{path.name}: cannot read ({exc})") from exc
        if stored is not None and stored != prompt:
            raise PromptError(f"{path.name} holds the embedding of a different prompt")
        if embeds.ndim == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.ndim != 2 or not embeds.is_floating_point():
            raise PromptError(f"{path.name}: {TENSOR} must be float (L, text_dim), got {tuple(embeds.shape)}")
        embeds = embeds.float()
        self._cache[prompt] = embeds
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return embeds
