"""ThroughputMeter: chunks per second per world from the engine time of its batches."""

from __future__ import annotations

import pytest

from runtime.throughput import ThroughputMeter


def test_nothing_is_measured_until_a_second_batch_of_a_size():
    m = ThroughputMeter()
    assert m.rate("w") is None
    assert m.record("w", 2, 30.0) is None  # the first batch may compile: not counted
    assert m.record("w", 2, 0.5) == pytest.approx(4.0)


def test_the_rate_is_the_best_batch_size_measured_and_follows_an_ewma():
    m = ThroughputMeter(alpha=0.5)
    for _ in range(2):
        m.record("w", 1, 0.25)  # 4 chunks/s alone
    assert m.rate("w") == pytest.approx(4.0)
    for _ in range(2):
        m.record("w", 4, 0.5)  # 8 chunks/s in batches of four
    assert m.rate("w") == pytest.approx(8.0)
    m.record("w", 4, 1.5)  # slower now: the mean moves half way, to 1 s a batch
    assert m.rate("w") == pytest.approx(4.0)
    assert m.rate("other") is None  # per world


def test_bad_samples_are_refused():
    m = ThroughputMeter()
    with pytest.raises(ValueError):
        m.record("w", 0, 1.0)
    with pytest.raises(ValueError):
        m.record("w", 1, 0.0)
