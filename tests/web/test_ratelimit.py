"""web/ratelimit.py: the token bucket, on a fake clock."""

import pytest

from web.ratelimit import TokenBucket


def test_burst_then_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=10, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] = 0.1  # one token back
    assert [bucket.take(), bucket.take()] == [True, False]
    now[0] = 100.0  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 3


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)


def test_charge_after_the_fact_goes_into_bounded_debt() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=10, burst=3, clock=lambda: now[0])
    assert bucket.take()
    bucket.charge(100)  # an expensive event: debt, floored at -burst
    assert not bucket.take()
    now[0] = 0.35  # -3 + 3.5 tokens
    assert [bucket.take(), bucket.take()] == [False, False]
    now[0] = 0.45  # -3 + 4.5
    assert [bucket.take(), bucket.take()] == [True, False]
