"""A per-target circuit breaker for connect attempts, and a model of one sshd's penalties.

The API is one source address for every user, and sshd (OpenSSH >= 9.8 PerSourcePenalties)
penalises a source that keeps failing; so after `threshold` consecutive connect failures we stop
trying for a jittered back-off that doubles up to a cap, then let a single trial through. A
refused login (`auth_failure`) opens the breaker at once, with a longer back-off of its own:
trying again soon will fail again, and each failure costs the whole address penalty time.

A target is one account (and, with certificates, one identity), so an account sshd refuses
opens its own breaker, not the host's. `Penalties` is shared by every target of one sshd: it
keeps the refused logins of all accounts together under sshd's threshold (see there).
"""

from __future__ import annotations

import random
from typing import Literal

State = Literal["closed", "open", "half_open"]


class Breaker:
    def __init__(
        self,
        threshold: int,
        backoff: float,
        backoff_max: float,
        auth_backoff: float | None = None,
        auth_backoff_max: float | None = None,
    ) -> None:
        self.threshold = threshold
        self.base = backoff
        self.backoff_max = backoff_max
        self.auth_base = auth_backoff if auth_backoff is not None else backoff
        self.auth_backoff_max = auth_backoff_max if auth_backoff_max is not None else backoff_max
        self._auth_backoff = self.auth_base
        self.state: State = "closed"
        self.failures = 0
        self._backoff = backoff
        self._open_until = 0.0
        self._trial_in_flight = False
        # Connections lost after their login but before any command ran on them, in a row
        # (`lost_before_start`); only a command that ran resets it (`served`).
        self.lost = 0

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
        """A login succeeded. The back-off starts again from its base only when the account's
        connections also serve commands: an account whose connections are lost before any
        command runs keeps its growing back-off (`lost_before_start`)."""
        self.state = "closed"
        self.failures = 0
        if not self.lost:
            self._backoff = self.base
        self._auth_backoff = self.auth_base
        self._trial_in_flight = False

    def served(self) -> None:
        """A command ran on one of the account's connections: its logins are healthy."""
        if self.lost:
            self.lost = 0
            self._backoff = self.base

    def lost_before_start(self, now: float) -> None:
        """A connection that logged in was lost before any command ran on it: the account's
        login shell or rc killed it (a `~/.bashrc` can), or the host failed. `threshold` of
        them in a row, with no command run between, open the breaker as connect failures do:
        a successful login proves nothing here, since such an account logs in every time. The
        account's failure, never its node's (sshpool.cluster judges nodes by its own probe)."""
        self.lost += 1
        self._trial_in_flight = False
        if self.lost >= self.threshold:
            self._open(now)

    def auth_failure(self, now: float) -> None:
        """sshd refused the login: open at once for the auth back-off, doubling to its cap."""
        self.failures += 1
        self._trial_in_flight = False
        self.state = "open"
        self._open_until = now + self._auth_backoff * random.uniform(0.5, 1.0)
        self._auth_backoff = min(self._auth_backoff * 2, self.auth_backoff_max)

    def failure(self, now: float) -> None:
        self.failures += 1
        self._trial_in_flight = False
        if self.state == "half_open" or self.failures >= self.threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = "open"
        # Full jitter in [backoff/2, backoff] so several replicas don't retry in step.
        self._open_until = now + self._backoff * random.uniform(0.5, 1.0)
        self._backoff = min(self._backoff * 2, self.backoff_max)


class Penalties:
    """Refused logins to one sshd, as its PerSourcePenalties counts them (OpenSSH >= 9.8, on by
    default): each adds `per_failure` seconds (`authfail`, default 5) to the source's penalty,
    which drains in real time, and once it reaches `threshold` (`min`, default 15) sshd refuses
    the whole address, every account, for that long. A login that may be refused (an account
    not known good) starts only while one more refusal stays under the threshold; accounts
    that logged in before are never held. At most threshold / per_failure refusals at once,
    then one per per_failure seconds, whatever the number of bad accounts."""

    def __init__(self, per_failure: float = 5.0, threshold: float = 15.0) -> None:
        self.per_failure = per_failure
        self.threshold = threshold
        self._score = 0.0
        self._at = 0.0
        self.refused = 0

    def score(self, now: float) -> float:
        """The penalty seconds sshd holds against us now."""
        return max(0.0, self._score - (now - self._at))

    def failure(self, now: float) -> None:
        self._score = self.score(now) + self.per_failure
        self._at = now
        self.refused += 1

    def merge(self, score: float, now: float) -> None:
        """Another process's view of the same sshd's penalty (`score` seconds now): keep the
        higher, so that its refusals hold back this process's risky logins too."""
        if score > self.score(now):
            self._score, self._at = score, now

    def allows(self, now: float) -> bool:
        """May a login that might be refused start now?"""
        return self.score(now) + self.per_failure < self.threshold
