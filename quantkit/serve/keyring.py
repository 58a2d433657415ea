"""API keys and per-key rate limits: the key ring behind `quantkit serve`'s gateway (the middleware is in auth.py).

Keys come from `--api-key` (any number, also `QUANTKIT_API_KEY`; no limits) or from `--api-keys-file`, a
TOML file of named keys with limits:

    [[keys]]
    name = "team-a"               # the label in /metrics and in logs; the key itself is never shown
    key = "sk-team-a-..."
    requests_per_minute = 60      # each limit is optional
    tokens_per_minute = 20000     # prompt + completion tokens
    concurrent_requests = 4

Requests and tokens per minute are token buckets holding one minute's allowance and refilling
continuously. A request needs one request token and a non-empty token bucket to start; its prompt and
completion tokens are charged when it ends (so the token bucket may go below zero, and the key waits
until it refills). Concurrent requests are a plain count. Keys are compared in constant time; logs
name a key by its name or, for an unknown key, by a short hash.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from quantkit.errors import QuantkitError

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None

    def __post_init__(self):
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise QuantkitError(f"API key limit {name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = field(repr=False)
    limits: KeyLimits = KeyLimits()


def fingerprint(key: str) -> str:
    """What logs show of a key: 8 hex digits of its SHA-256, never the key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:8]


def load_keys_file(path: Path) -> list[ApiKey]:
    """Named keys with limits from a TOML file (see the module docstring); one-line errors."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise QuantkitError(f"cannot read API keys file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise QuantkitError(f"API keys file {path} is not valid TOML: {e}") from None
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise QuantkitError(f"API keys file {path} has no [[keys]] entries")
    keys = []
    for i, entry in enumerate(entries):
        unknown = set(entry) - {"name", "key", *LIMIT_FIELDS}
        if unknown:
            raise QuantkitError(f"API keys file {path}: keys[{i}] has unknown field(s) {', '.join(sorted(unknown))}")
        for req in ("name", "key"):
            if not isinstance(entry.get(req), str) or not entry[req]:
                raise QuantkitError(f"API keys file {path}: keys[{i}] needs a non-empty string '{req}'")
        keys.append(ApiKey(entry["name"], entry["key"], KeyLimits(**{f: entry.get(f) for f in LIMIT_FIELDS})))
    return check_unique(keys)


def plain_keys(keys: Iterable[str]) -> list[ApiKey]:
    """`--api-key` values: no limits, named key-1, key-2, ... (their order on the command line)."""
    return check_unique([ApiKey(f"key-{i + 1}", k) for i, k in enumerate(keys)])


def check_unique(keys: list[ApiKey]) -> list[ApiKey]:
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise QuantkitError("API key names must be unique")
    if len({k.key for k in keys}) != len(keys):
        raise QuantkitError("the same API key is given twice")
    return keys


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; the level may go negative (debt)."""

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity, self.rate = capacity, rate
        self.level, self._last = capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._last) * self.rate)
        self._last = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` tokens are there (0 when they are now)."""
        return max(0.0, (amount - self.level) / self.rate)


@dataclass
class RateLimited(Exception):
    """Over a limit: which one, its value, and after how many seconds a retry can succeed."""

    key_name: str
    limit: str  # one of LIMIT_FIELDS
    value: int
    retry_after: float

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))

    def body(self) -> dict:
        what = self.limit.replace("_", " ")
        return {"error": {
            "message": f"Rate limit reached for API key '{self.key_name}' on {what}: limit {self.value}. "
                       f"Please try again in {self.retry_after_header}s.",
            "type": self.limit, "param": None, "code": "rate_limit_exceeded"}}


def unauthorized_body() -> dict:
    return {"error": {"message": "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


@dataclass
class _KeyState:
    limits: KeyLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0
    requests_total: int = 0
    tokens_total: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LIMIT_FIELDS, 0))


class Lease:
    """One admitted request of a key. `add_tokens` as its engine requests end; `release()` when the HTTP
    request ends (once), which charges the tokens added so far (plus `num_tokens`)."""

    def __init__(self, ring: KeyRing, key: ApiKey):
        self._ring, self.key, self._done, self.tokens = ring, key, False, 0

    def add_tokens(self, n: int) -> None:
        if self._done:  # used after the HTTP request ended (a stream's tail): charged at once
            self._ring._charge(self.key.name, n)
        else:
            self.tokens += n

    def release(self, num_tokens: int = 0) -> None:
        if not self._done:
            self._done = True
            self._ring._release(self.key.name, self.tokens + num_tokens)


class KeyRing:
    """The server's keys, their buckets and usage counters. Thread-safe; `clock` is injectable for tests."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        self.keys, self._clock = check_unique(list(keys)), clock
        self._lock = threading.Lock()
        now = clock()
        self._state = {k.name: _KeyState(
            k.limits,
            _bucket(k.limits.requests_per_minute, now), _bucket(k.limits.tokens_per_minute, now)) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer <key>` header names, or None. Every key is compared, each in
        constant time, so the time taken says nothing about which key or how much of it matched."""
        scheme, _, given = (authorization or "").partition(" ")
        given_b = given.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for k in self.keys:
            if hmac.compare_digest(given_b, k.key.encode()) and given_b:
                found = k
        return found

    def admit(self, key: ApiKey) -> Lease:
        """Start a request of `key`, or raise RateLimited naming the first limit it is over (nothing taken)."""
        with self._lock:
            st, now = self._state[key.name], self._clock()
            for bucket in (st.requests, st.tokens):
                if bucket is not None:
                    bucket.refill(now)
            over = self._first_limit_over(st)
            if over is not None:
                limit, retry_after = over
                st.rejected[limit] += 1
                raise RateLimited(key.name, limit, getattr(st.limits, limit), retry_after)
            if st.requests is not None:
                st.requests.level -= 1
            st.in_flight += 1
            st.requests_total += 1
        return Lease(self, key)

    @staticmethod
    def _first_limit_over(st: _KeyState) -> tuple[str, float] | None:
        cap = st.limits.concurrent_requests
        if cap is not None and st.in_flight >= cap:
            return "concurrent_requests", 1.0  # unknown: when one in flight ends
        if st.requests is not None and st.requests.level < 1:
            return "requests_per_minute", st.requests.wait_for(1)
        if st.tokens is not None and st.tokens.level <= 0:
            return "tokens_per_minute", st.tokens.wait_for(1)  # any token left is enough to start
        return None

    def _release(self, name: str, num_tokens: int) -> None:
        with self._lock:
            self._state[name].in_flight -= 1
        self._charge(name, num_tokens)

    def _charge(self, name: str, num_tokens: int) -> None:
        with self._lock:
            st = self._state[name]
            st.tokens_total += num_tokens
            if st.tokens is not None:
                st.tokens.refill(self._clock())
                st.tokens.level -= num_tokens

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._state[name].in_flight

    def collect(self):
        """prometheus-client collector protocol: per-key usage, labelled by the key's NAME."""
        reqs = CounterMetricFamily("quantkit:api_key_requests", "Requests admitted, by API key name.",
                                   labels=["key_name"])
        toks = CounterMetricFamily("quantkit:api_key_tokens",
                                   "Prompt plus completion tokens of finished requests, by API key name.",
                                   labels=["key_name"])
        rej = CounterMetricFamily("quantkit:api_key_rate_limited",
                                  "Requests refused by a per-key limit, by API key name and limit.",
                                  labels=["key_name", "limit"])
        with self._lock:
            for name, st in self._state.items():
                reqs.add_metric([name], st.requests_total)
                toks.add_metric([name], st.tokens_total)
                for limit, n in st.rejected.items():
                    rej.add_metric([name, limit], n)
        return [reqs, toks, rej]


def _bucket(per_minute: int | None, now: float) -> TokenBucket | None:
    return None if per_minute is None else TokenBucket(per_minute, per_minute / 60.0, now)
