"""What callers send: argv byte-exactness, raw shell policy, templates, bad bodies, limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from api_helpers import Api

TRICKY = [
    "it's",
    '"double"',
    "$(id)",
    "`id`",
    "a;b && c || d",
    "line1\nline2",
    "ünïcødé ✓ 日本語",
    "$HOME ${PATH}",
    "*",
    "--help",
    "  spaced  ",
    "back\\slash",
    "tab\there",
    "",
]


async def test_argv_elements_arrive_byte_exact(api: Api) -> None:
    """Quotes, $(), backticks, ;, newlines, globs and unicode reach the program unchanged."""
    r = await api.submit({"host": "local", "argv": ["printf", "%s\\0", *TRICKY]})
    assert r.status_code == 201, r.text
    assert r.json()["stdout"] == "".join(f"{a}\0" for a in TRICKY)


async def test_argv_with_nul_byte_is_422(api: Api) -> None:
    """A NUL byte cannot be passed through a shell: refused before anything runs."""
    r = await api.submit({"host": "local", "argv": ["echo", "a\0b"]})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"


async def test_raw_shell_line_runs_where_policy_allows(api: Api) -> None:
    """A raw shell line is interpreted by the remote shell (pipes work)."""
    r = await api.submit({"host": "local", "command": "printf abc | wc -c"})
    assert r.status_code == 201, r.text
    assert r.json()["stdout"].strip() == "3"


async def test_raw_shell_line_is_403_where_policy_forbids(api: Api) -> None:
    """A subject without shell permission gets 403 for `command` but may still send argv."""
    r = await api.submit({"host": "local", "command": "id"}, sub="noshell")
    assert r.status_code == 403
    assert r.json()["type"].endswith("shell-forbidden")
    r = await api.submit({"host": "local", "argv": ["true"]}, sub="noshell")
    assert r.status_code == 201


async def test_stdin_reaches_the_command(api: Api) -> None:
    """`stdin` is written to the command, then EOF."""
    r = await api.submit({"host": "local", "argv": ["wc", "-c"], "stdin": "12345"})
    assert r.json()["stdout"].strip() == "5"


async def test_invalid_utf8_output_is_replaced_and_counted(api: Api) -> None:
    """Bytes that are not UTF-8 become U+FFFD; stdout_bytes counts the raw bytes."""
    r = await api.submit({"host": "local", "argv": ["printf", "\\377abc"]})
    job = r.json()
    assert (job["stdout"], job["stdout_bytes"]) == ("\ufffdabc", 4)
    assert "U+FFFD" in job["encoding"]


async def test_output_beyond_the_policy_cap_is_truncated(api: Api) -> None:
    """Output past max_output keeps the head, counts everything and flags truncation."""
    r = await api.submit({"host": "local", "command": "head -c 100000 /dev/zero | tr '\\0' x"})
    job = r.json()
    assert job["stdout_truncated"] is True
    assert job["stdout_bytes"] == 100_000
    assert len(job["stdout"]) == 65_536


async def test_template_params_are_typed_separate_arguments(api: Api) -> None:
    """A template's params land as whole argv elements: shell metacharacters stay inert."""
    body = {"host": "local", "template": "greet", "params": {"count": 3, "word": "a b;$(id)"}}
    r = await api.submit(body)
    assert r.status_code == 201, r.text
    assert r.json()["stdout"] == "<3|a b;$(id)>"
    assert r.json()["template"] == "greet"


async def test_template_param_validation_is_422(api: Api) -> None:
    """Wrong type, out of range, pattern mismatch, unknown or missing params: 422."""
    bad = [
        {"count": "3", "word": "x"},
        {"count": 11, "word": "x"},
        {"count": 1, "word": "a/b"},
        {"count": 1, "word": "x", "extra": 1},
        {"word": "x"},
    ]
    for params in bad:
        r = await api.submit({"host": "local", "template": "greet", "params": params})
        assert r.status_code == 422, (params, r.text)
        assert r.headers["content-type"] == "application/problem+json"


async def test_template_value_starting_with_dash_cannot_become_an_option(api: Api) -> None:
    """'-x' is refused where it would be read as an option, and accepted after a literal '--'
    (grep then searches for the pattern '-v' instead of inverting)."""
    r = await api.submit(
        {"host": "local", "template": "greet", "params": {"count": 1, "word": "-x"}}
    )
    assert r.status_code == 422
    r = await api.submit({"host": "local", "template": "grep_null", "params": {"pattern": "-v"}})
    assert r.status_code == 201, r.text
    assert (r.json()["stdout"], r.json()["exit_status"]) == ("0\n", 1)
    assert r.json()["argv"] == ["grep", "-c", "--", "-v", "/dev/null"]


async def test_unknown_template_is_422(api: Api) -> None:
    """A template name that is not configured is refused."""
    r = await api.submit({"host": "local", "template": "nope", "params": {}})
    assert r.status_code == 422
    assert r.json()["type"].endswith("unknown-template")


async def test_malformed_bodies_are_422_problems(api: Api) -> None:
    """Broken JSON, wrong shapes, unknown fields, two kinds at once: 422 problem+json."""
    headers = {**api.auth(), "Content-Type": "application/json"}
    bodies = [
        "{not json",
        "[]",
        json.dumps({"host": "local"}),
        json.dumps({"host": "local", "argv": ["a"], "command": "b"}),
        json.dumps({"host": "local", "argv": []}),
        json.dumps({"host": "local", "argv": "echo"}),
        json.dumps({"host": "local", "argv": ["true"], "shell": True}),
        json.dumps({"host": "local", "argv": ["true"], "timeout": -1}),
        json.dumps({"host": "local", "command": "x", "params": {"a": 1}}),
    ]
    for body in bodies:
        r = await api.client.post(f"{api.url}/v1/jobs", content=body, headers=headers)
        assert r.status_code == 422, (body, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == 422


async def test_huge_body_is_413(api: Api) -> None:
    """A body over max_body_bytes is refused from its Content-Length, before it is read."""
    body = {"host": "local", "argv": ["echo", "x" * 100_000]}
    r = await api.submit(body)
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"


async def test_huge_streamed_body_is_413(api: Api) -> None:
    """A chunked body (no Content-Length) is cut off once it passes the cap."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"host": "local", "argv": ["echo", "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"]}'

    headers = {**api.auth(), "Content-Type": "application/json"}
    r = await api.client.post(f"{api.url}/v1/jobs", content=chunks(), headers=headers)
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"


async def test_stdin_over_the_cap_is_413(api: Api) -> None:
    """stdin beyond max_stdin_bytes is refused and nothing runs."""
    r = await api.submit({"host": "local", "argv": ["wc", "-c"], "stdin": "x" * 2000})
    assert r.status_code == 413


async def test_unknown_host_is_422_and_forbidden_host_403(api: Api) -> None:
    """A host that is not configured is 422; one the policy does not grant is 403."""
    r = await api.submit({"host": "nowhere", "argv": ["true"]})
    assert (r.status_code, r.json()["type"].split(":")[-1]) == (422, "unknown-host")
    r = await api.submit({"host": "secret", "argv": ["true"]})
    assert (r.status_code, r.json()["type"].split(":")[-1]) == (403, "host-forbidden")
    listed = await api.client.get(f"{api.url}/v1/jobs", headers=api.auth())
    assert listed.json()["items"] == []  # refused requests created nothing


async def test_timeout_is_capped_by_policy(api: Api) -> None:
    """A requested timeout above the policy's max_timeout is lowered to it."""
    r = await api.submit({"host": "local", "argv": ["true"], "timeout": 99999})
    assert r.json()["timeout"] == 60
