"""Configuration checks that fail at start, not at request time; template rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.config import Config, TemplateConfig, load_config
from api.policy import Policy, render
from api.problems import Problem
from sshpool import Limits

ISSUER = {"issuer": "sshapi-local", "audience": "a"}
HOST = {"hostname": "h", "username": "u", "client_keys": ["k"], "known_hosts": "kh"}


def config(**over: Any) -> Config:
    return Config.model_validate({"issuers": [ISSUER], **over})


def test_root_login_needs_allow_root() -> None:
    """A host or policy account mapping to root is refused unless allow_root is set."""
    with pytest.raises(ValidationError, match="allow_root"):
        config(hosts={"h": {**HOST, "username": "root"}})
    with pytest.raises(ValidationError, match="allow_root"):
        config(
            hosts={"h": HOST},
            policy=[{"issuer": "*", "accounts": {"h": {"username": "root", "client_keys": ["k"]}}}],
        )
    config(hosts={"h": {**HOST, "username": "root", "allow_root": True}})


def test_algorithm_none_and_unknown_algorithms_are_refused() -> None:
    """`none` (or any unknown name) in an issuer's algorithm list fails validation."""
    for algs in (["none"], ["HS256", "foo"]):
        with pytest.raises(ValidationError):
            config(issuers=[{**ISSUER, "algorithms": algs}])


def test_asymmetric_issuer_needs_keys() -> None:
    """RS256 without PEM keys or a JWKS URL is a configuration error."""
    with pytest.raises(ValidationError, match="keys or JWKS"):
        config(issuers=[{**ISSUER, "algorithms": ["RS256"]}])


def test_unknown_keys_are_refused() -> None:
    """A typo in the file fails the start instead of being ignored."""
    with pytest.raises(ValidationError):
        config(api={"wait_defualt": 3})


def test_template_placeholders_must_be_declared_and_not_the_program() -> None:
    """Every {name} needs a params entry; argv[0] cannot be a parameter."""
    with pytest.raises(ValidationError, match="params"):
        TemplateConfig(argv=["echo", "{x}"])
    with pytest.raises(ValidationError, match="program"):
        TemplateConfig.model_validate({"argv": ["{x}"], "params": {"x": {}}})


def test_render_keeps_optional_params_out_and_embeds_values() -> None:
    """An optional param left out drops its element; embedded placeholders are substituted."""
    t = TemplateConfig.model_validate(
        {
            "argv": ["squeue", "--user={user}", "{state}"],
            "params": {"user": {}, "state": {"required": False, "choices": ["R", "PD"]}},
        }
    )
    assert render("t", t, {"user": "alice"}) == ["squeue", "--user=alice"]
    assert render("t", t, {"user": "-x", "state": "R"}) == ["squeue", "--user=-x", "R"]
    with pytest.raises(Problem):
        render("t", t, {"user": "alice", "state": "X"})


def test_example_configuration_loads() -> None:
    """api/sshapi.example.toml (quoted in the README) is a valid configuration."""
    config = load_config(Path(__file__).parents[2] / "api" / "sshapi.example.toml")
    assert list(config.hosts) == ["login1"]
    assert config.policy[0].accounts["login1"].username == "alice"
    assert render("squeue_me", config.templates["squeue_me"], {}) == [
        "squeue",
        "--me",
        "--states=PENDING,RUNNING",
        "--format=%i %j %T %M",
    ]


def test_host_backend_and_limits_reach_the_target() -> None:
    """A host's backend and pool limits from the TOML tables become its sshpool Target's."""
    host = {**HOST, "backend": "ssh2", "limits": {"max_sessions": 6, "reuse": False}}
    target = config(hosts={"h": host}).hosts["h"].target()
    assert (target.backend, target.limits.max_sessions, target.limits.reuse) == ("ssh2", 6, False)
    with pytest.raises(ValidationError, match="backend"):
        config(hosts={"h": {**HOST, "backend": "libssh"}})
    with pytest.raises(ValidationError, match="max_sesions"):
        config(hosts={"h": {**HOST, "limits": {"max_sesions": 6}}})


def test_ssh_budget_counts_the_pools_of_all_replicas() -> None:
    """The example host (4 handshakes, 4 x 8 sessions; stock MaxStartups 10) fits 2 replicas;
    3 would exceed MaxStartups and the site's 64 sessions, each named with its arithmetic."""
    host = load_config(Path(__file__).parents[2] / "api" / "sshapi.example.toml").hosts["login1"]
    assert host.ssh_budget(1) == []
    assert host.ssh_budget(2) == []
    problems = host.ssh_budget(3)
    assert any("3 replica(s) x max_handshakes 4 >= MaxStartups 10" in p for p in problems)
    assert any("= 96 > max_total_sessions 64" in p for p in problems)
    assert host.model_copy(update={"limits": Limits(max_sessions=10)}).ssh_budget(1) == [
        "max_sessions 10 >= MaxSessions 10: no spare channel per connection"
    ]


def test_ssh_budget_counts_the_handshakes_a_pool_can_have_in_flight() -> None:
    """The default gate (6 handshakes per sshd) fits one pool on a stock sshd, not two with
    many accounts; with one account a pool opens at most its 4 connections at once, so two fit."""
    host = load_config(Path(__file__).parents[2] / "api" / "sshapi.example.toml").hosts["login1"]
    host = host.model_copy(update={"limits": Limits()})
    assert not any("MaxStartups" in p for p in host.ssh_budget(1, accounts=200))
    assert any(
        "2 replica(s) x max_handshakes 6 >= MaxStartups 10" in p
        for p in host.ssh_budget(2, accounts=200)
    )
    assert not any("MaxStartups" in p for p in host.ssh_budget(2, accounts=1))
    assert any(
        "3 replica(s) x 1 account(s) x max_connections 4 >= MaxStartups 10" in p
        for p in host.ssh_budget(3, accounts=1)
    )


def test_host_names_that_share_one_sshd_count_their_accounts_together() -> None:
    """Two host names on one address and port are one sshd to the pool: the budget check
    counts the accounts of both (3 here: each host's own, and alice's on the second)."""
    alice = {"username": "alice", "client_keys": ["k"]}
    cfg = config(
        hosts={"a": HOST, "b": {**HOST, "username": "v"}, "c": {**HOST, "port": 2222}},
        policy=[{"issuer": "*", "accounts": {"b": alice}}],
    )
    policy = Policy(cfg)
    assert len(policy.targets("a")) == 1
    assert len(policy.sshd_targets("a")) == len(policy.sshd_targets("b")) == 3
    assert len(policy.sshd_targets("c")) == 1


def test_ssh_budget_in_agent_mode_counts_the_executor_and_sftp_channels() -> None:
    """Agent mode: the executor's channel and max_sessions - 1 SFTP sessions per connection,
    the same spare below MaxSessions; max_sessions 1 leaves SFTP no channel."""
    example = Path(__file__).parents[2] / "api" / "sshapi.example.toml"
    host = load_config(example).hosts["login1"].model_copy(update={"exec_mode": "agent"})
    assert host.ssh_budget(1) == []
    assert host.model_copy(update={"limits": Limits(max_sessions=10)}).ssh_budget(1) == [
        "max_sessions 10 >= MaxSessions 10: the executor's channel and max_sessions - 1 SFTP "
        "sessions leave no spare channel per connection"
    ]
    assert host.model_copy(update={"limits": Limits(max_sessions=1)}).ssh_budget(1) == [
        "exec_mode agent with max_sessions 1: no channel for SFTP beside the executor"
    ]


def test_exec_mode_auto_is_the_default_and_needs_no_sftp_channel_with_one_session() -> None:
    """A host that says nothing runs "auto"; with max_sessions 1 "auto" runs channels (an
    executor would leave SFTP no channel), so the budget names no agent-mode problem."""
    example = Path(__file__).parents[2] / "api" / "sshapi.example.toml"
    host = load_config(example).hosts["login1"]
    assert host.exec_mode == "auto" and host.target().exec_mode == "auto"
    assert host.model_copy(update={"limits": Limits(max_sessions=1)}).ssh_budget(1) == []
    assert config(hosts={"h": HOST}).hosts["h"].exec_mode == "auto"


_DASH_TEMPLATE = TemplateConfig.model_validate(
    {"argv": ["grep", "-c", "{pattern}", "--", "{path}"], "params": {"pattern": {}, "path": {}}}
)


@settings(max_examples=300, deadline=None)
@given(pattern=st.text(), path=st.text())
def test_template_values_never_become_options_or_extra_arguments(pattern: str, path: str) -> None:
    """Property: a value before `--` that starts with '-' is refused (422); any other value,
    whatever it holds (spaces, quotes, newlines), is exactly one argv element, where the
    operator put it."""
    if "\0" in pattern + path:
        return  # NUL is refused earlier, by the request schema
    if pattern.startswith("-"):
        with pytest.raises(Problem) as refused:
            render("grep", _DASH_TEMPLATE, {"pattern": pattern, "path": path})
        assert refused.value.status == 422
        return
    argv = render("grep", _DASH_TEMPLATE, {"pattern": pattern, "path": path})
    assert argv == ["grep", "-c", pattern, "--", path]


_PIECES = st.lists(
    st.one_of(
        st.sampled_from(["{a}", "{b}", "{c}"]),
        st.text(alphabet="x-=/.", min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(
    elements=st.lists(_PIECES, min_size=1, max_size=3),
    values=st.fixed_dictionaries(
        {k: st.text(alphabet="-x= ", max_size=3) for k in ("a", "b", "c")}
    ),
)
# Found on a fresh clone: after a literal "--" a value may start with '-' (not an option there).
@example(elements=[["--"], ["{c}"]], values={"a": "", "b": "", "c": "-"})
def test_no_rendered_element_becomes_an_option_whatever_the_placeholders(
    elements: list[list[str]], values: dict[str, str]
) -> None:
    """Property over elements mixing several placeholders and literal text: either the call is
    refused (422), or every rendered element that starts with '-' before a literal "--" element
    was written with that '-' by the operator: values (empty ones included) never make an
    option. After "--" every element is an operand, whatever it starts with."""
    argv = ["prog", *("".join(pieces) for pieces in elements)]
    template = TemplateConfig.model_validate(
        {"argv": argv, "params": {k: {} for k in ("a", "b", "c")}}
    )
    try:
        rendered = render("t", template, values)
    except Problem as refused:
        assert refused.status == 422
        return
    after_dashdash = False
    for written, out in zip(argv[1:], rendered[1:], strict=True):
        if out.startswith("-") and not after_dashdash:
            assert written.startswith("-"), (written, values, out)
        after_dashdash = after_dashdash or written == "--"


def test_ssh_budget_counts_every_account_of_the_sshd() -> None:
    """Sessions are counted over the host's sshd: each account's connections until the pool's
    per-sshd budget (max_total_connections) caps them."""
    host = load_config(Path(__file__).parents[2] / "api" / "sshapi.example.toml").hosts["login1"]
    assert host.ssh_budget(1, accounts=2) == []
    assert host.ssh_budget(1, accounts=3) == [
        "1 replica(s) x 3 account(s) x max_connections 4 x max_sessions 8 = 96 > "
        "max_total_sessions 64"
    ]
    assert host.ssh_budget(1, accounts=1000) == [
        "1 replica(s) x max_total_connections 64 x max_sessions 8 = 512 > max_total_sessions 64"
    ]
