"""The first matching policy rule applies, whatever mix of literal and glob rules a site writes
(Policy indexes the literal ones: a rule per researcher, thousands of them)."""

from __future__ import annotations

from typing import Any

from api.auth import Principal
from api.config import Config
from api.policy import Policy

ISS = "sshapi-local"


def policy(rules: list[dict[str, Any]]) -> Policy:
    host = {
        "hostname": "127.0.0.1",
        "username": "svc",
        "client_keys": ["/nonexistent/key"],
        "known_hosts": "/nonexistent/known_hosts",
    }
    hosts = {name: host for name in ("a", "b", "c", "d")}
    config = {
        "issuers": [{"issuer": ISS, "audience": "x", "algorithms": ["HS256"]}],
        "hosts": hosts,
        "policy": [{"issuer": ISS, **rule} for rule in rules],
    }
    return Policy(Config.model_validate(config))


def hosts_of(p: Policy, subject: str, issuer: str = ISS) -> list[str] | None:
    rule = p.rule_for(Principal(issuer, subject, frozenset()))
    return None if rule is None else rule.hosts


def test_the_first_matching_rule_wins_between_literal_and_glob_rules() -> None:
    p = policy(
        [
            {"subject": "ali*", "hosts": ["a"]},
            {"subject": "alice", "hosts": ["b"]},  # after ali*: never alice's
            {"subject": "bob", "hosts": ["b"]},
            {"subject": "bob", "hosts": ["c"]},  # a second rule for bob: never his
            {"subject": "*", "hosts": ["c"]},
            {"subject": "carol", "hosts": ["d"]},  # after the catch-all: never carol's
        ]
    )
    assert hosts_of(p, "alice") == ["a"]
    assert hosts_of(p, "alicia") == ["a"]
    assert hosts_of(p, "bob") == ["b"]
    assert hosts_of(p, "carol") == ["c"]
    assert hosts_of(p, "dave") == ["c"]


def test_a_literal_rule_before_a_glob_one_wins_and_the_issuer_is_part_of_the_match() -> None:
    p = policy(
        [
            {"subject": "r0001", "hosts": ["a"]},
            {"subject": "r0002", "hosts": ["b"]},
            {"subject": "r*", "hosts": ["c"]},
        ]
    )
    assert hosts_of(p, "r0001") == ["a"]
    assert hosts_of(p, "r0002") == ["b"]
    assert hosts_of(p, "r0003") == ["c"]
    assert hosts_of(p, "x") is None
    assert hosts_of(p, "r0001", issuer="https://idp.example") is None
    # Glob characters in a subject are matched as patterns, never looked up as literals.
    q = policy([{"subject": "[ab]ob", "hosts": ["a"]}, {"subject": "?", "hosts": ["b"]}])
    assert hosts_of(q, "bob") == ["a"]
    assert hosts_of(q, "[ab]ob") is None
    assert hosts_of(q, "z") == ["b"]
