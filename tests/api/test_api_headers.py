"""Hostile header values (huge digit strings, superscript and other non-ASCII digits, junk)
against the files, live-output and jobs routes of `sshapi serve` on the rig: never a 500. The
numbers the API reads from a request are ASCII digits of bounded count (api/numbers.py).
Figures are printed as `FIGURE name: value`."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import requests
import schemathesis
from api_helpers import Api, Keys, config_toml, make_settings, server_process
from faults import figure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.config import load_config
from api.numbers import BEYOND, read_count
from sshpool.devhost import LocalHost

POLICY = """
[[policy]]
subject = "hdr-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
rate = 1000
burst = 1000

"""
SCOPES = "files:read files:write jobs:read jobs:write"
CONTENT = bytes(range(256)) * 40  # 10,240 bytes
DIGITS = "9" * 5000  # past int()'s 4,300-digit limit

# Per header: values aimed at how it is read (huge numbers, superscripts, which str.isdigit()
# takes for digits and which arrive as such, being Latin-1; other scripts' digits, arriving as
# UTF-8 bytes read as Latin-1; signs, exponents, separators), plus junk any header may get
# (non-ASCII text, an empty value, a value near the 32 KiB header cap).
ANY = ["ünïcödé", "\U0001f600", "\u202e", "", "-1", "+5", "1_000", '"' + "x" * 24000 + '"']
HOSTILE = {
    "Range": [
        "bytes=" + DIGITS + "-",
        "bytes=0-" + DIGITS,
        "bytes=-" + DIGITS,
        "bytes=" + DIGITS + "-" + DIGITS,
        "bytes=9223372036854775807-",
        "bytes=18446744073709551616-0",
        "bytes=²-³",
        "bytes=0-¹",
        "bytes=\u0661-\u0663",
        "bytes=1e3-",
    ],
    "Last-Event-ID": [
        "²-³",
        "0-²",
        "¹²-0",
        DIGITS[:30] + "-" + DIGITS[:30],
        "18446744073709551616-0",
        "\u0661-\u0662",
        "-",
        "1-2-3",
    ],
    "If-Match": ['W/"²"', '"' + DIGITS + '"', "*", '"\u0663"', DIGITS],
    "If-None-Match": ['W/"²"', '"' + DIGITS + '"', "²", DIGITS, '"a", "b", ' * 50],
    "Prefer": ["wait=²", "wait=" + DIGITS, "wait=1e308", "wait=\u0663", "wait=-1", "wait=0.²"],
    "Idempotency-Key": [DIGITS, "²", "\u0663" * 100, "k" * 300],
    "X-Request-ID": [DIGITS, "²", "\u0663", "../../etc"],
}
# Content-Length values only that no parser takes for a length: a number that does not match
# the body would leave the request waiting for bytes that never come (until the deadline).
BAD_LENGTHS = ["²", "\u0663", DIGITS, "-1", "0x10", "1e3", "+5", "1_000", "18446744073709551616"]
# 5xx the routes document for SSH failures; anything else 5xx is a defect.
SSH_STATUSES = {502, 503, 504}


@contextmanager
def hostile_server(
    host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path
) -> Iterator[tuple[str, Path]]:
    text = config_toml(host, secret_file, keys).replace("[[policy]]", POLICY + "[[policy]]", 1)
    config_file = tmp_path / "sshapi.toml"
    config_file.write_text(text)
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    with server_process(settings_) as (_, url):
        yield url, config_file


@asynccontextmanager
async def user_with_a_file(
    url: str, config_file: Path, host: LocalHost, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[tuple[Api, str, dict[str, str], str, str]]:
    """The API, a user with a file root holding one file (uploaded), and a finished job of
    theirs: (api, subject, auth headers, the file's path, the job id)."""
    sub = f"hdr-{uuid.uuid4().hex[:10]}"
    root = Path(host.account.home) / "sshapi-files" / sub
    host.run_local(["mkdir", "-p", str(root)])
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            api = Api(url, client, secret, load_config(config_file), settings_, keys)
            headers = api.auth(sub, SCOPES)
            path = f"{root}/data.bin"
            r = await client.put(
                f"{url}/v1/hosts/local/files/content",
                params={"path": path},
                content=CONTENT,
                headers=headers,
            )
            assert r.status_code == 201, r.text
            r = await client.post(
                f"{url}/v1/jobs",
                json={"host": "local", "argv": ["echo", "hi"]},
                headers={**headers, "Prefer": "wait=10"},
            )
            assert r.status_code == 201, r.text
            yield api, sub, headers, path, r.json()["id"]
    finally:
        host.run_local(["rm", "-rf", str(root)])


def test_numbers_are_ascii_digits_of_bounded_count() -> None:
    """What api/numbers.py reads, and what it refuses without calling int() on it."""
    assert read_count("0") == 0 and read_count(b"1234") == 1234
    assert read_count("9" * 19) == int("9" * 19)
    for junk in ("", "²", "¹²³", "٣", " 7", "-1", "+5", "1_000", "0x10", "1e3", "7\n"):
        assert read_count(junk) is None, junk
    assert read_count(DIGITS) is None
    assert read_count(DIGITS, saturate=True) == BEYOND
    assert read_count(DIGITS.encode(), saturate=True) == BEYOND


async def test_range_and_last_event_id_with_huge_or_superscript_digits_are_not_500(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """A Range of 5,000 digits: start beyond the file 416, end or suffix past it the whole file
    as 206; superscript digits in a Range are no range (200, the whole file); a Last-Event-ID
    with superscript digits or 20 digits is 422 (both were 500s)."""
    with hostile_server(tuned_host, secret_file, keys, tmp_path) as (url, config_file):
        async with user_with_a_file(url, config_file, tuned_host, secret, keys, tmp_path) as (
            api,
            _,
            headers,
            path,
            job_id,
        ):
            content = f"{url}/v1/hosts/local/files/content"

            async def download(range_: bytes) -> httpx.Response:
                return await api.client.get(
                    content, params={"path": path}, headers={**headers, "Range": range_}
                )

            start = await download(b"bytes=" + DIGITS.encode() + b"-")
            end = await download(b"bytes=0-" + DIGITS.encode())
            suffix = await download(b"bytes=-" + DIGITS.encode())
            superscript = await download("bytes=²-³".encode("latin-1"))
            events = f"{url}/v1/jobs/{job_id}/events"
            sup_id = await api.client.get(
                events, headers={**headers, "Last-Event-ID": "²-0".encode("latin-1")}
            )
            long_id = await api.client.get(
                events, headers={**headers, "Last-Event-ID": "9" * 20 + "-0"}
            )
    figure(
        "Range 5,000-digit start / end / suffix, superscripts; Last-Event-ID ²-0, 20 digits",
        [r.status_code for r in (start, end, suffix, superscript, sup_id, long_id)],
    )
    assert start.status_code == 416, start.text
    assert start.headers["Content-Range"] == f"bytes */{len(CONTENT)}"
    assert start.json()["type"] == "urn:sshapi:problem:range-not-satisfiable"
    for whole in (end, suffix):
        assert whole.status_code == 206, whole.text
        assert whole.headers["Content-Range"] == f"bytes 0-{len(CONTENT) - 1}/{len(CONTENT)}"
        assert whole.content == CONTENT
    assert superscript.status_code == 200 and superscript.content == CONTENT
    for bad in (sup_id, long_id):
        assert bad.status_code == 422, bad.text
        assert bad.json()["type"] == "urn:sshapi:problem:invalid-event-id"


def raw_request(prepared: requests.PreparedRequest, hostile: dict[str, str]) -> bytes:
    """`prepared` as HTTP/1.1 bytes with `hostile` headers in place of its own of those names,
    values as UTF-8 (Latin-1 characters such as superscripts: their own byte)."""
    headers = {k: v for k, v in prepared.headers.items() if k.lower() not in {"connection"}}
    for name in hostile:
        for key in [k for k in headers if k.lower() == name.lower()]:
            del headers[key]
    lines = [f"{prepared.method} {prepared.path_url} HTTP/1.1".encode(), b"Host: x"]
    lines += [f"{k}: {v}".encode() for k, v in headers.items() if k.lower() != "host"]
    for name, value in hostile.items():
        try:
            encoded = value.encode("latin-1")
        except UnicodeEncodeError:
            encoded = value.encode()
        lines.append(name.encode() + b": " + encoded)
    lines.append(b"Connection: close")
    body = prepared.body or b""
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body.encode() if isinstance(body, str) else body)


def status_of(port: int, request: bytes) -> int:
    """Send `request`, read the status code (0: closed without one; -1: none in 15 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        try:
            sock.sendall(request)
            line = sock.makefile("rb").readline()
        except TimeoutError:
            return -1
        except ConnectionError:
            return 0
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def fuzz_headers(
    raw: dict[str, Any], url: str, headers: dict[str, str], path: str, job_id: str, examples: int
) -> tuple[list[str], Counter[int]]:
    """schemathesis's cases for the files, live-output and jobs operations, three in four aimed
    at the user's real host, file and job, each sent with hostile values for all the
    headers of HOSTILE (and one in four a Content-Length no parser takes). Returns the defects
    and the statuses."""
    schema = schemathesis.openapi.from_dict(raw)
    port = int(url.rsplit(":", 1)[1])
    wrong: list[str] = []
    seen: Counter[int] = Counter()
    # Every header in every request, with a value of its own list or of ANY.
    hostile_headers = st.fixed_dictionaries(
        {name: st.sampled_from(values) | st.sampled_from(ANY) for name, values in HOSTILE.items()}
    )

    def checker(operation: Any) -> Any:
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        @given(
            case=operation.as_strategy(),
            hostile=hostile_headers,
            real=st.sampled_from([True, True, True, False]),
            length=st.sampled_from(BAD_LENGTHS),
            send_length=st.sampled_from([False, False, False, True]),
        )
        def check(
            case: Any, hostile: dict[str, str], real: bool, length: str, send_length: bool
        ) -> None:
            if real:
                if "host" in case.path_parameters:
                    case.path_parameters["host"] = "local"
                if "job_id" in case.path_parameters:
                    case.path_parameters["job_id"] = job_id
                if case.method == "GET" and isinstance(case.query, dict) and "path" in case.query:
                    case.query["path"] = path
            if operation.method.upper() == "POST" and operation.path == "/v1/jobs":
                case.body = {"host": "local", "argv": ["true"]}  # the headers are the test
            kwargs = case.as_transport_kwargs(base_url=url, headers=headers)
            prepared = requests.Request(**kwargs).prepare()
            if send_length:
                prepared.body, hostile = b"", {**hostile, "Content-Length": length}
            status = status_of(port, raw_request(prepared, hostile))
            seen[status] += 1
            if status <= 0 or (status >= 500 and status not in SSH_STATUSES):
                shown = {k: v[:24] for k, v in hostile.items()}
                wrong.append(f"{case.method} {prepared.path_url[:80]} {shown}: {status}")

        return check

    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.startswith(("/v1/jobs", "/v1/hosts/{host}/files")):
            checker(operation)()
    return wrong, seen


async def test_hostile_headers_on_files_live_and_jobs_routes_are_never_5xx(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """schemathesis generates requests for every files, live-output and jobs operation (three
    in four for the user's real host, file and job), each with hostile values for all of Range,
    Last-Event-ID, If-Match, If-None-Match, Prefer, Idempotency-Key, X-Request-ID, and one in
    four with a Content-Length no parser takes: every answer comes, none is 5xx but the SSH
    failures' 502, 503 and 504."""
    with hostile_server(tuned_host, secret_file, keys, tmp_path) as (url, config_file):
        async with user_with_a_file(url, config_file, tuned_host, secret, keys, tmp_path) as (
            api,
            _,
            headers,
            path,
            job_id,
        ):
            raw = (await api.client.get(f"{url}/openapi.json")).json()
            wrong, seen = await asyncio.to_thread(fuzz_headers, raw, url, headers, path, job_id, 25)
    figure("hostile-header requests sent", sum(seen.values()))
    figure("statuses seen", sorted(seen.items()))
    figure("5xx (not SSH) or no answer", (len(wrong), wrong[:3]))
    assert wrong == []
