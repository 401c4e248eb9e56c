"""The encoded-prompt cache: bytes-bounded LRU shared by sessions; EncodedPrompts' limits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from models.text_prompts import EncodedPrompts, PromptCache
from models.umt5.load import load_text_encoder
from models.umt5.tokenizer import PromptTooLong
from tests.fixtures.golden.served import write_umt5_dir


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # 16 bytes a row


def test_cache_evicts_least_recently_used_past_its_bytes() -> None:
    cache = PromptCache(max_bytes=100)
    cache.put("a", rows(2))  # 32
    cache.put("b", rows(2))  # 64
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", rows(3))  # 112 > 100: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("huge", rows(10))  # 160 > the whole cache: not stored, nothing evicted for it
    assert cache.get("huge") is None
    stats = cache.stats()
    assert (stats.entries, stats.nbytes, stats.evictions) == (2, 80, 1)
    cache.put("a", rows(1))  # replacing an entry frees its old bytes
    assert cache.stats().nbytes == 64
    with pytest.raises(ValueError):
        PromptCache(-1)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("tokenizers")
    return load_text_encoder(write_umt5_dir(tmp_path_factory.mktemp("umt5")))


def test_prompts_share_one_cache_and_each_world_keeps_its_limit(encoder) -> None:
    cache = PromptCache()
    short, long_ = EncodedPrompts(encoder, cache, 8), EncodedPrompts(encoder, cache, 512)
    assert short.problem("a red car on a beach") is None  # 7 tokens
    assert "at most 8" in (short.problem("a red car on a beach at night") or "")
    assert long_.prepare("a red car on a beach at night") is False  # encoded
    assert long_.prepare("a  red car on a beach at night ") is True  # the same once cleaned
    with pytest.raises(PromptTooLong):
        short.embed("a red car on a beach at night")  # cached, yet too long for this world
    assert short.prepare("a red car") is False and long_.prepare("a red car") is True
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 2, 2)


def test_concurrent_requests_for_one_prompt_encode_it_once(encoder, monkeypatch) -> None:
    prompts = EncodedPrompts(encoder, PromptCache(), 512)
    calls = []
    encode = encoder.encode_ids
    gate = threading.Barrier(4)

    def slow(ids: list[int]) -> torch.Tensor:
        calls.append(ids)
        time.sleep(0.2)  # the others arrive while this one encodes
        return encode(ids)

    monkeypatch.setattr(encoder, "encode_ids", slow)

    def ask() -> None:
        gate.wait()
        prompts.embed("a castle at night")

    workers = [threading.Thread(target=ask) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1


def test_embed_after_an_eviction_encodes_again(encoder) -> None:
    prompts = EncodedPrompts(encoder, PromptCache(max_bytes=7 * 32 * 4), 512)  # one 7-token prompt
    first = prompts.embed("a red car on a beach")
    prompts.embed("a castle at night under")  # evicts the first
    assert torch.equal(prompts.embed("a red car on a beach"), first)
    assert prompts.cache.stats().misses == 3
