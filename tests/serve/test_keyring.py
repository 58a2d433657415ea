"""API keys and per-key limits, on an injected clock: exact admissions, Retry-After, usage counters."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from quantkit.errors import QuantkitError
from quantkit.serve.keyring import ApiKey, KeyLimits, KeyRing, RateLimited, fingerprint, load_keys_file, plain_keys


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ring_with(clock: Clock, **limits) -> tuple[KeyRing, ApiKey]:
    key = ApiKey("team-a", "sk-secret-a", KeyLimits(**limits))
    return KeyRing([key, ApiKey("team-b", "sk-secret-b")], clock=clock), key


def test_bearer_key_is_found_and_wrong_ones_are_not():
    ring, key = ring_with(Clock())
    assert ring.authenticate("Bearer sk-secret-a") is key
    assert ring.authenticate("bearer sk-secret-b").name == "team-b"
    for bad in (None, "", "Bearer", "Bearer ", "Bearer sk-secret", "Basic sk-secret-a", "sk-secret-a"):
        assert ring.authenticate(bad) is None, bad


def test_requests_per_minute_exactly_n_then_retry_after_that_succeeds():
    clock = Clock()
    ring, key = ring_with(clock, requests_per_minute=3)
    for _ in range(3):
        ring.admit(key).release()
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    assert (e.value.limit, e.value.value) == ("requests_per_minute", 3)
    assert e.value.retry_after == pytest.approx(20.0)  # one request refills in 60 s / 3
    assert e.value.retry_after_header == "20"
    clock.now += 19.9
    with pytest.raises(RateLimited):
        ring.admit(key)
    clock.now += 0.1
    ring.admit(key).release()  # honoured Retry-After: admitted
    with pytest.raises(RateLimited):
        ring.admit(key)


def test_a_refused_request_takes_nothing():
    clock = Clock()
    ring, key = ring_with(clock, requests_per_minute=2, concurrent_requests=1)
    lease = ring.admit(key)
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    assert e.value.limit == "concurrent_requests"
    lease.release()
    ring.admit(key).release()  # the refused one did not use the second request token
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    assert e.value.limit == "requests_per_minute"


def test_concurrency_is_held_until_release_once():
    ring, key = ring_with(Clock(), concurrent_requests=2)
    a, b = ring.admit(key), ring.admit(key)
    with pytest.raises(RateLimited):
        ring.admit(key)
    a.release()
    a.release()  # twice is once
    assert ring.in_flight("team-a") == 1
    ring.admit(key)
    b.release()


def test_tokens_per_minute_charged_at_release_with_debt():
    clock = Clock()
    ring, key = ring_with(clock, tokens_per_minute=600)  # 10 tokens / s
    ring.admit(key).release(num_tokens=650)  # admitted with a full bucket; now 50 in debt
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    assert e.value.limit == "tokens_per_minute"
    assert e.value.retry_after == pytest.approx(5.1)  # back to 1 token: (1 + 50) / 10
    assert e.value.retry_after_header == "6"
    clock.now += 5.1
    lease = ring.admit(key)
    lease.add_tokens(30)
    lease.release()
    lease.add_tokens(30)  # after the release (a stream's tail): still charged
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    assert e.value.retry_after == pytest.approx(6.0)  # (1 + 59) / 10: both 30s charged


def test_the_429_body_is_openai_shaped_and_names_the_limit():
    ring, key = ring_with(Clock(), requests_per_minute=1)
    ring.admit(key)
    with pytest.raises(RateLimited) as e:
        ring.admit(key)
    err = e.value.body()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests_per_minute"
    assert "requests per minute" in err["message"] and "team-a" in err["message"]
    assert "sk-secret-a" not in str(e.value.body())


def test_usage_counters_carry_the_key_name_never_the_key():
    clock = Clock()
    ring, key = ring_with(clock, requests_per_minute=1)
    ring.admit(key).release(num_tokens=12)
    with pytest.raises(RateLimited):
        ring.admit(key)
    reg = CollectorRegistry()
    reg.register(ring)
    text = generate_latest(reg).decode()
    assert 'quantkit:api_key_requests_total{key_name="team-a"} 1.0' in text
    assert 'quantkit:api_key_tokens_total{key_name="team-a"} 12.0' in text
    assert 'quantkit:api_key_rate_limited_total{key_name="team-a",limit="requests_per_minute"} 1.0' in text
    assert "sk-secret" not in text


def test_key_repr_and_fingerprint_hide_the_key():
    key = ApiKey("n", "sk-very-secret")
    assert "sk-very-secret" not in repr(key)
    assert fingerprint("sk-very-secret").startswith("sha256:") and len(fingerprint("x")) == 15
    assert fingerprint("a") != fingerprint("b")


def test_keys_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nname = "a"\nkey = "k1"\nrequests_per_minute = 5\ntokens_per_minute = 100\n'
                    '[[keys]]\nname = "b"\nkey = "k2"\nconcurrent_requests = 2\n')
    a, b = load_keys_file(path)
    assert a.limits == KeyLimits(requests_per_minute=5, tokens_per_minute=100)
    assert b.limits == KeyLimits(concurrent_requests=2)


@pytest.mark.parametrize("text, message", [
    ('[[keys]]\nname = "a"\n', "needs a non-empty string 'key'"),
    ('[[keys]]\nname = "a"\nkey = "k"\nrpm = 3\n', "unknown field(s) rpm"),
    ('[[keys]]\nname = "a"\nkey = "k"\nrequests_per_minute = 0\n', "requests_per_minute must be a whole number"),
    ('[[keys]]\nname = "a"\nkey = "k"\n[[keys]]\nname = "a"\nkey = "j"\n', "names must be unique"),
    ('title = "x"\n', "no [[keys]] entries"),
    ('[[keys]\n', "not valid TOML"),
])
def test_keys_file_errors_are_one_line(tmp_path, text, message):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(QuantkitError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_keys_file(path)


def test_missing_file_and_plain_keys(tmp_path):
    with pytest.raises(QuantkitError, match="cannot read API keys file"):
        load_keys_file(tmp_path / "nope.toml")
    assert [k.name for k in plain_keys(["x", "y"])] == ["key-1", "key-2"]
    with pytest.raises(QuantkitError, match="given twice"):
        plain_keys(["x", "x"])
    assert not KeyRing([]).enabled


def test_serve_with_an_unreadable_keys_file_is_a_one_line_error(tmp_path, stories_dir):
    from tests_support.cli import run_cli

    code, out = run_cli("serve", stories_dir, "--port", "0", "--api-keys-file", tmp_path / "missing.toml")
    assert code != 0
    assert "cannot read API keys file" in out and "Traceback" not in out
