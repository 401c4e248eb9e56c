"""A token bucket: the per-connection limit on client messages (``rate_limited``)."""

import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """Allows ``rate`` events a second on average and bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate  # tokens added per second
        self.burst = burst  # bucket size, tokens
        self._clock = clock  # seconds, monotonic
        self._tokens = burst
        self._last = clock()

    def take(self) -> bool:
        """Spend one token; False (nothing spent) when the bucket is empty."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def charge(self, tokens: float) -> None:
        """Spend ``tokens`` after the fact (work an event turned out to cost). The bucket may go
        into debt, down to ``-burst``: later ``take`` calls fail until the refill repays it."""
        self._refill()
        self._tokens = max(-self.burst, self._tokens - tokens)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
