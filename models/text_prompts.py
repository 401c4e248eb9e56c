"""Prompt text -> embeddings by a text encoder in the server, with a bounded cache shared by every
session (and every world) that uses the encoder.

`EncodedPrompts` is a world's `PromptSource` (models/world.py): `problem` tokenizes only (cheap:
the length check), `prepare` encodes into the cache (the runtime calls it on its prompt worker,
off the engine thread and the event loop), `embed` reads the cache in `World.init_state`, and
encodes there only when the entry was evicted between the two (more than the cache's bytes of
other prompts encoded in that moment).

`PromptCache`: least recently used first out, bounded in bytes of the stored embeddings (each
prompt's own rows in float32, no padding: a 30-token UMT5-XXL prompt is 0.5 MB, a 512-token one
8 MiB). Keyed by the cleaned prompt text, so prompts that differ only in spacing share an entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from models.umt5.load import TextEncoder
from models.umt5.tokenizer import PromptTooLong, clean_prompt
from models.world import World

DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass
class CacheStats:
    """What the cache did since it was made (read by /metrics)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    nbytes: int = 0


class PromptCache:
    """Thread-safe LRU of prompt -> (tokens, dim) float32 embeddings, bounded by `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"prompt cache bytes must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embeddings (now the most recently used), or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: str, value: torch.Tensor) -> None:
        """Store `value`, evicting the least recently used entries past `max_bytes`; a value larger
        than the whole cache is not stored."""
        size = value.numel() * value.element_size()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._stats.nbytes -= old.numel() * old.element_size()
            if size > self.max_bytes:
                return
            self._items[key] = value
            self._stats.nbytes += size
            while self._stats.nbytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self._stats.nbytes -= gone.numel() * gone.element_size()
                self._stats.evictions += 1

    def count(self, hit: bool) -> None:
        """Record one request's outcome."""
        with self._lock:
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1

    def stats(self) -> CacheStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self._stats, entries=len(self._items))


def attach(worlds: Iterable[World], encoder: TextEncoder, cache: PromptCache) -> int:
    """Give every text world (`text_prompts`) its `EncodedPrompts` over the shared encoder and
    cache; the number attached. ValueError when a world's text width is not the encoder's."""
    n = 0
    for world in worlds:
        if not world.config.text_prompts:
            continue
        tcfg = world.transformer.cfg
        if tcfg.text_dim != encoder.cfg.dim:
            raise ValueError(
                f"model {world.config.id} takes {tcfg.text_dim}-wide text, the text encoder makes "
                f"{encoder.cfg.dim}-wide embeddings"
            )
        world.prompts = EncodedPrompts(encoder, cache, tcfg.text_tokens)
        n += 1
    return n


class EncodedPrompts:
    """A world's prompts through a shared text encoder and cache; `max_tokens` is the world's own
    limit (its text length, at most the encoder's)."""

    def __init__(self, encoder: TextEncoder, cache: PromptCache, max_tokens: int) -> None:
        self.encoder = encoder
        self.cache = cache
        self.max_tokens = min(max_tokens, encoder.cfg.text_len)
        self._encode_lock = threading.Lock()  # one encode at a time: one model, its memory once

    def problem(self, prompt: str) -> str | None:
        """Why `prompt` cannot be encoded (too many tokens), or None. Tokenizes, runs no model."""
        try:
            self.encoder.ids(prompt, self.max_tokens)
        except PromptTooLong as exc:
            return str(exc)
        return None

    def prepare(self, prompt: str) -> bool:
        """Make sure `prompt` is in the cache, counting a hit or a miss; True when it already was.
        Raises PromptTooLong."""
        hit = self._lookup(prompt)[1]
        self.cache.count(hit)
        return hit

    def embed(self, prompt: str) -> torch.Tensor:
        """(tokens, dim) float32 embeddings of `prompt`, from the cache `prepare` filled (an encode
        here, after an eviction, counts as a miss); raises PromptTooLong."""
        value, hit = self._lookup(prompt)
        if not hit:
            self.cache.count(False)
        return value

    def _lookup(self, prompt: str) -> tuple[torch.Tensor, bool]:
        key = clean_prompt(prompt)
        hit = self.cache.get(key)
        if hit is None:
            with self._encode_lock:
                hit = self.cache.get(key)  # encoded by another caller while this one waited
                if hit is None:
                    value = self.encoder.encode(prompt, self.max_tokens)
                    self.cache.put(key, value)
                    return value, False
        return self._check(hit), True

    def _check(self, value: torch.Tensor) -> torch.Tensor:
        if value.shape[0] > self.max_tokens:  # cached for a world with a longer limit
            raise PromptTooLong(f"prompt is {value.shape[0]} tokens, this model takes {self.max_tokens}")
        return value
