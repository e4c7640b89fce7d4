"""A per-host circuit breaker for connect attempts.

The API is one source address for every user, and sshd (OpenSSH >= 9.8 PerSourcePenalties)
penalises a source that keeps failing; so after `threshold` consecutive connect failures we stop
trying for a jittered back-off that doubles up to a cap, then let a single trial through.
"""

from __future__ import annotations

import random
from typing import Literal

State = Literal["closed", "open", "half_open"]


class Breaker:
    def __init__(self, threshold: int, backoff: float, backoff_max: float) -> None:
        self.threshold = threshold
        self.base = backoff
        self.backoff_max = backoff_max
        self.state: State = "closed"
        self.failures = 0
        self._backoff = backoff
        self._open_until = 0.0
        self._trial_in_flight = False

    def allow(self, now: float) -> bool:
        """May a connect attempt start now? Moving to half-open lets exactly one through."""
        if self.state == "closed":
            return True
        if self.state == "open" and now >= self._open_until:
            self.state = "half_open"
        if self.state == "half_open" and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def may_try(self, now: float) -> bool:
        """Would `allow(now)` let an attempt through? Changes nothing."""
        if self.state == "closed":
            return True
        if self.state == "open" and now < self._open_until:
            return False
        return not self._trial_in_flight

    def is_open(self, now: float) -> bool:
        """True while callers should be refused at once instead of queued."""
        return self.state == "open" and now < self._open_until

    def retry_after(self, now: float) -> float:
        return max(0.0, self._open_until - now)

    def success(self) -> None:
        self.state = "closed"
        self.failures = 0
        self._backoff = self.base
        self._trial_in_flight = False

    def failure(self, now: float) -> None:
        self.failures += 1
        self._trial_in_flight = False
        if self.state == "half_open" or self.failures >= self.threshold:
            self.state = "open"
            # Full jitter in [backoff/2, backoff] so several replicas don't retry in step.
            self._open_until = now + self._backoff * random.uniform(0.5, 1.0)
            self._backoff = min(self._backoff * 2, self.backoff_max)
