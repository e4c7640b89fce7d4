"""Hostile input at the HTTP edge: OpenAPI-driven fuzzing (schemathesis) and one user's burst
against another user's latency. Figures are printed as `FIGURE name: value`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from api_helpers import (
    Api,
    Keys,
    OwnHostApi,
    config_toml,
    make_settings,
    running_api,
    server_process,
)
from faults import figure
from hypothesis import HealthCheck, given, settings

from api.config import load_config
from sshpool.devhost import LocalHost

PUBLIC = {"/healthz", "/readyz", "/metrics"}


def streams(operation: Any) -> bool:
    """Whether the operation answers an event stream (the change feed, a job's events): one
    that a valid token opens never ends by itself."""
    answers = operation.definition.raw.get("responses", {}).get("200", {})
    return "text/event-stream" in answers.get("content", {})


def send(case: Any, url: str, stream: bool) -> tuple[int, str]:
    """The case's status and the start of its answer. An event stream is read up to its
    status and closed: schemathesis would wait for the end of a feed that has none (the fuzz
    ran into its 300 s timeout once the change feed was an operation)."""
    if not stream:
        r = case.call(base_url=url, timeout=60)
        return r.status_code, r.text
    kwargs = case.as_transport_kwargs(base_url=url)
    request = httpx.Request(
        kwargs["method"], kwargs["url"], params=kwargs.get("params"),
        headers=kwargs.get("headers"), cookies=kwargs.get("cookies"),
        content=kwargs.get("data") if isinstance(kwargs.get("data"), str | bytes) else None,
    )  # fmt: skip
    with httpx.Client(timeout=60) as client:
        answer = client.send(request, stream=True)
        try:
            text = answer.read().decode(errors="replace") if answer.status_code >= 400 else ""
            return answer.status_code, text
        finally:
            answer.close()


def fuzz(
    raw: dict[str, Any], url: str, token: str, examples: int
) -> tuple[list[str], Counter[str]]:
    """Every operation of the schema with generated inputs, each sent with a valid token, with
    none and with a forged one. Returns what went wrong, and the statuses seen."""
    schema = schemathesis.openapi.from_dict(raw)
    wrong: list[str] = []
    seen: Counter[str] = Counter()

    def checker(operation: Any) -> Any:
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            for name, auth in (
                ("valid token", f"Bearer {token}"),
                ("no token", None),
                ("forged token", "Bearer eyJhbGciOiJub25lIn0.eyJzdWIiOiJhZG1pbiJ9."),
            ):
                headers = {k: v for k, v in (case.headers or {}).items()
                           if k.lower() != "authorization"}  # fmt: skip
                if auth is not None:
                    headers["Authorization"] = auth
                case.headers = headers
                status, text = send(case, url, streams(operation))
                seen[f"{operation.label} {name} {status}"] += 1
                if status >= 500:
                    wrong.append(f"{operation.label} ({name}): {status} {text[:200]}")
                public = operation.path in PUBLIC
                if name != "valid token" and not public and status != 401:
                    wrong.append(f"{operation.label} ({name}): {status}, not 401")

        return check

    for result in schema.get_all_operations():
        checker(result.ok())()
    return wrong, seen


@pytest.mark.slow
async def test_openapi_fuzzing_finds_no_5xx_and_no_unauthenticated_access(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """schemathesis generates requests for every operation of our own OpenAPI document: none is
    answered 5xx, and every operation but the public probes answers 401 without a token or
    with a forged one."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    with server_process(settings_) as (_, url):
        async with httpx.AsyncClient() as client:
            api = Api(url, client, secret, load_config(config_file), settings_, keys)
            raw = (await client.get(f"{url}/openapi.json")).json()
            token = api.token("fuzzer", "jobs:read jobs:write")
            wrong, seen = await asyncio.to_thread(fuzz, raw, url, token, 30)
    figure("schemathesis: requests sent", sum(seen.values()))
    figure("schemathesis: answers with a valid token", sorted(k for k in seen if "valid" in k))
    figure("schemathesis: 5xx or unauthenticated access", len(wrong))
    assert wrong == []


async def test_one_users_burst_gets_429s_and_leaves_the_other_user_alone(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """`tenant-b` sends 5 jobs/s throughout; `tenant-a` bursts at 10x that (50/s) for 3 s.
    Both have the same rule (20/s, burst 20, 8 at once): a's excess is 429, b gets none, and
    b's p95 is printed alone and during a's burst (the 10 % goal is a figure, not asserted)."""
    rule = """[[policy]]
subject = "tenant-*"
issuer = "*"
hosts = ["local"]
rate = 20
burst = 20
max_concurrent = 8

"""
    text = config_toml(tuned_host, secret_file, keys)
    path = tmp_path / "tenants.toml"
    path.write_text(text.replace('[[policy]]\nsubject = "*"', rule + '[[policy]]\nsubject = "*"'))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:

        async def paced(sub: str, rate: float, seconds: float) -> list[tuple[int, float]]:
            async def one(delay: float) -> tuple[int, float]:
                await asyncio.sleep(delay)
                t0 = time.perf_counter()
                r = await api.submit({"host": "local", "argv": ["true"]}, sub=sub)
                return r.status_code, (time.perf_counter() - t0) * 1000

            n = int(rate * seconds)
            return await asyncio.gather(*(one(i / rate) for i in range(n)))

        await paced("tenant-b", 5, 1)  # warm the pool
        alone = await paced("tenant-b", 5, 3)
        burst, during = await asyncio.gather(paced("tenant-a", 50, 3), paced("tenant-b", 5, 3))

    def p95(results: list[tuple[int, float]]) -> float:
        return statistics.quantiles([ms for _, ms in results], n=20)[18]

    a_codes = Counter(code for code, _ in burst)
    b_codes = Counter(code for code, _ in alone + during)
    figure("burst: tenant-a statuses", dict(a_codes))
    figure("burst: tenant-b statuses", dict(b_codes))
    change = (p95(during) / p95(alone) - 1) * 100
    figure("burst: tenant-b p95 alone / during a's burst (ms)",
           f"{p95(alone):.1f} / {p95(during):.1f} ({change:+.0f} %)")  # fmt: skip
    assert a_codes[429] > 0
    assert set(b_codes) == {201}


# ---- issue 15: exhaustion and leaks. Each test reproduces one reported attack against the real
# server and checks the bound; figures go to RELIABILITY.md ("Hostile input: exhaustion and leaks").


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MB, from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def test_job_list_stays_small_whatever_the_jobs_printed(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """16 jobs printing 1 MiB of NULs on each stream, then `GET /v1/jobs?limit=200`: the list
    carries no output (read through /output), so it stays a few KB and the API's RSS flat."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    with server_process(settings_) as (proc, url):
        async with httpx.AsyncClient(timeout=120) as client:
            api = Api(url, client, secret, load_config(config_file), settings_, keys)
            line = "head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2"
            for _ in range(2):
                rs = await asyncio.gather(
                    *(
                        api.submit({"host": "local", "command": line}, sub="anyhost", wait=30)
                        for _ in range(8)
                    )
                )
                assert {r.status_code for r in rs} == {201}, [r.text[:200] for r in rs]
            before, _ = rss_mb(proc.pid)
            headers = api.auth("anyhost")
            r = await client.get(f"{url}/v1/jobs?limit=200", headers=headers)
            after, peak = rss_mb(proc.pid)
            assert r.status_code == 200
            items = r.json()["items"]
            assert len(items) == 16
            figure("list of 16 jobs x 2 MiB output: response bytes", len(r.content))
            figure("list of 16 jobs x 2 MiB output: API RSS before / after / peak (MB)",
                   f"{before:.0f} / {after:.0f} / {peak:.0f}")  # fmt: skip
            assert all("stdout" not in item and "stderr" not in item for item in items)
            assert items[0]["stdout_bytes"] == 1 << 20
            one = await client.get(
                f"{url}/v1/jobs/{items[0]['id']}/output?stream=stderr", headers=headers
            )
            assert one.content == b"\0" * (1 << 20)
    assert len(r.content) < 64 * 1024
    assert after - before < 32


def descriptors(pid: int) -> int:
    """How many file descriptors a process has open."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


async def healthz_latencies(url: str, until: asyncio.Future[Any]) -> list[float]:
    """GET /healthz every 50 ms on fresh connections until `until` is done; the latencies in ms
    (a refused or timed-out probe counts as 5,000 ms)."""
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        while not until.done():
            t0 = time.perf_counter()
            try:
                ok = (await c.get(f"{url}/healthz")).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append((time.perf_counter() - t0) * 1000 if ok else 5000.0)
            await asyncio.sleep(0.05)
    return latencies


async def test_huge_tokens_and_headers_are_refused_cheaply(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """A 21 MiB bearer token is refused by the server before the app sees it (431), a token over
    8 KiB is a 401 `invalid_token` without being decoded, a valid 32 MiB token is never accepted,
    and /healthz stays fast meanwhile."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    with server_process(settings_) as (_, url):
        async with httpx.AsyncClient(timeout=60) as client:
            api = Api(url, client, secret, load_config(config_file), settings_, keys)
            junk = "eyJhbGciOiJIUzI1NiJ9." + "A" * (21 << 20) + ".sig"
            big = api.token("alice", pad="x" * (32 << 20))
            medium = api.token("alice", pad="x" * 9000)

            def huge(token: str) -> tuple[int, float]:
                # In a thread of its own: sending 21 MiB must not slow this loop's probes.
                t0 = time.perf_counter()
                try:
                    with httpx.Client(timeout=60) as own:
                        headers = {"Authorization": f"Bearer {token}"}
                        status = own.get(f"{url}/v1/jobs", headers=headers).status_code
                except httpx.HTTPError:
                    status = 0  # the server closed the connection while we were still sending
                return status, (time.perf_counter() - t0) * 1000

            loop = asyncio.get_running_loop()
            done: asyncio.Future[Any] = loop.create_future()
            probes = asyncio.create_task(healthz_latencies(url, done))
            await asyncio.sleep(0.3)
            (junk_status, junk_ms) = await asyncio.to_thread(huge, junk)
            (big_status, big_ms) = await asyncio.to_thread(huge, big)
            await asyncio.sleep(0.3)
            done.set_result(None)
            latencies = await probes
            t0 = time.perf_counter()
            r = await client.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {medium}"})
            medium_ms = (time.perf_counter() - t0) * 1000
    figure("21 MiB junk token: status, ms", (junk_status, round(junk_ms)))
    figure("valid 32 MiB token: status, ms", (big_status, round(big_ms)))
    figure("9 KiB valid token: status, ms", (r.status_code, round(medium_ms, 1)))
    figure("/healthz meanwhile: probes, max ms", (len(latencies), round(max(latencies), 1)))
    assert junk_status in (431, 0) and big_status in (431, 0)
    assert r.status_code == 401
    assert 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    assert "too large" in r.json()["detail"]
    # Blocked, the probes time out (5 s each, counted as 5000); the bound leaves room for a busy
    # shared box (1.7 s seen at load 9) and still tells a served probe from a stalled loop.
    assert max(latencies) < 3000


async def test_idle_and_half_sent_connections_are_closed_and_cannot_exhaust_descriptors(
    config_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Under a 256-descriptor limit, 300 connections that send nothing, half a header or half a
    body: /healthz keeps answering, and every one of them is closed by the server within its
    header or body deadline."""
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    extra = {
        "SSHAPI_HEADER_TIMEOUT": "2",
        "SSHAPI_BODY_TIMEOUT": "3",
        "SSHAPI_MAX_CONNECTIONS": "150",
    }
    wrapper = ("prlimit", "--nofile=256")
    with server_process(settings_, extra_env=extra, wrapper=wrapper) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        sends = [
            b"",
            b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthor",
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"host": ',
        ]
        opened: list[tuple[float, int, asyncio.StreamReader, asyncio.StreamWriter]] = []
        for n in range(300):
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), 2
                )
            except (OSError, TimeoutError):
                continue
            writer.write(sends[n % 3])
            opened.append((time.perf_counter(), n % 3, reader, writer))
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=5) as client:
            health = await client.get(f"{url}/healthz")
        health_ms = (time.perf_counter() - t0) * 1000

        async def closed_after(start: float, reader: asyncio.StreamReader) -> float:
            try:
                async with asyncio.timeout(15):
                    while await reader.read(65536):
                        pass
            except ConnectionError:
                pass
            except TimeoutError:
                return float("inf")
            return time.perf_counter() - start

        waits = await asyncio.gather(*(closed_after(t, r) for t, _, r, _ in opened))
        for *_, writer in opened:
            writer.close()
        fds = descriptors(proc.pid)
    by_kind = {kind: max(w for (_, k, _, _), w in zip(opened, waits, strict=True) if k == kind)
               for kind in range(3)}  # fmt: skip
    figure("300 idle/half-sent sockets: connected, /healthz status and ms",
           (len(opened), health.status_code, round(health_ms, 1)))  # fmt: skip
    figure("closed after at most (s): nothing / half a header / half a body",
           tuple(round(by_kind[k], 2) for k in range(3)))  # fmt: skip
    figure("API descriptors afterwards", fds)
    assert health.status_code == 200
    assert len(opened) == 300
    assert by_kind[0] < 4 and by_kind[1] < 4 and by_kind[2] < 6


UPLOAD_POLICY = """
[[policy]]
subject = "slow-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }

"""


async def test_slow_steady_uploads_pass_the_body_deadline_and_tricklers_do_not(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Body deadline 2 s, the default minimum rate (64 KiB/s): an upload sent in 64 KiB chunks
    every 0.3 s (~210 KiB/s) for over 4 s is stored whole (201, same sha256), while one that
    trickles 1 KiB every 0.3 s is answered 408 and closed long before it is done."""
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", UPLOAD_POLICY + "[[policy]]", 1
    )
    config_file = tmp_path / "sshapi.toml"
    config_file.write_text(text)
    settings_ = make_settings(tmp_path, config_file, "sqlite", None)
    sub = f"slow-{uuid.uuid4().hex[:10]}"
    root = Path(tuned_host.account.home) / "sshapi-files" / sub
    tuned_host.run_local(["mkdir", "-p", str(root)])
    chunk, chunks = os.urandom(64 << 10), 15
    try:
        with server_process(settings_, extra_env={"SSHAPI_BODY_TIMEOUT": "2"}) as (_, url):
            async with httpx.AsyncClient(timeout=30) as client:
                api = Api(url, client, secret, load_config(config_file), settings_, keys)
                headers = api.auth(sub, "files:read files:write")

                async def steady() -> AsyncIterator[bytes]:
                    for _ in range(chunks):
                        yield chunk
                        await asyncio.sleep(0.3)

                t0 = time.perf_counter()
                r = await client.put(
                    f"{url}/v1/hosts/local/files/content",
                    params={"path": f"{root}/steady.bin"},
                    content=steady(),
                    headers={**headers, "Content-Length": str(len(chunk) * chunks)},
                )
                steady_s = time.perf_counter() - t0
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"PUT /v1/hosts/local/files/content?path={root}/trickle.bin HTTP/1.1\r\n"
                f"Host: x\r\nAuthorization: {headers['Authorization']}\r\n"
                f"Content-Length: {1 << 20}\r\n\r\n".encode()
            )

            async def trickle() -> int:
                sent = 0
                with contextlib.suppress(ConnectionError):
                    while sent < 1 << 20:
                        writer.write(b"x" * 1024)
                        await writer.drain()
                        sent += 1024
                        await asyncio.sleep(0.3)
                return sent

            t0 = time.perf_counter()
            sending = asyncio.create_task(trickle())
            async with asyncio.timeout(20):
                answer = await reader.read()  # to the server's close
            trickle_s = time.perf_counter() - t0
            sending.cancel()
            writer.close()
    finally:
        tuned_host.run_local(["rm", "-rf", str(root)])
    figure("steady 960 KiB upload over (s), status", (round(steady_s, 2), r.status_code))
    figure("trickler closed after (s)", round(trickle_s, 2))
    assert steady_s > 4
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == hashlib.sha256(chunk * chunks).hexdigest()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert trickle_s < 10  # 1 MiB at 1 KiB per 0.3 s would take 5 minutes


async def test_validation_errors_are_capped_in_count_and_size(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Bodies under the 1 MiB cap made of many mistakes: 90,000 unknown keys (979 KB) are one
    error naming a few; 10,000 non-string argv elements list the first 20 errors and the
    count; a 100 KB key name is not echoed whole. Each 422 stays under 8 KB and the server
    spends little CPU on them."""
    text = config_toml(tuned_host, secret_file, keys).replace(
        "max_body_bytes = 65536", "max_body_bytes = 1048576"
    )
    path = tmp_path / "big-bodies.toml"
    path.write_text(text)
    settings_ = make_settings(tmp_path, path, "sqlite", None)
    body: dict[str, Any] = {"host": "local", "argv": ["true"]}
    body.update({f"k{n:05d}": 0 for n in range(90_000)})
    bodies = {
        "unknown keys": json.dumps(body, separators=(",", ":")).encode(),
        "bad argv": json.dumps({"host": "local", "argv": [0] * 10_000}).encode(),
        "long key": json.dumps({"host": "local", "argv": ["true"], "x" * 100_000: 1}).encode(),
    }
    answers: dict[str, tuple[httpx.Response, float]] = {}
    with server_process(settings_) as (proc, url):
        async with httpx.AsyncClient(timeout=60) as client:
            api = Api(url, client, secret, load_config(path), settings_, keys)
            headers = {**api.auth(), "Content-Type": "application/json"}
            cpu = psutil.Process(proc.pid)
            for name, raw in bodies.items():
                before = sum(cpu.cpu_times()[:2])
                r = await client.post(f"{url}/v1/jobs", content=raw, headers=headers)
                answers[name] = (r, sum(cpu.cpu_times()[:2]) - before)
    for name, (r, spent) in answers.items():
        figure(f"422 for {name}: body bytes, answer bytes, server CPU s",
               (len(bodies[name]), len(r.content), round(spent, 3)))  # fmt: skip
        assert r.status_code == 422
        assert len(r.content) < 8192
    unknown = answers["unknown keys"][0].json()
    assert unknown["errors_total"] == 1 and "89995 more" in unknown["detail"]
    argv = answers["bad argv"][0].json()
    assert len(argv["errors"]) == 20 and argv["errors_total"] == 10_000


async def test_ssh_failures_name_the_host_and_kind_never_paths_or_accounts(
    api_with_own_host: OwnHostApi, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused connection and a replaced host key: answers and stored jobs name the host and
    what went wrong, never the remote account, a key or known_hosts path, or user@host:port;
    the server's log keeps the detail."""
    caplog.set_level(logging.WARNING)
    async with api_with_own_host("leaky") as (api, leaky):
        secrets_ = [leaky.username, str(leaky.known_hosts), str(leaky.client_key), "/"]
        texts: dict[str, str] = {}
        leaky.stop(kill_sessions=True)
        refused = await api.submit({"host": "leaky", "argv": ["true"]}, sub="anyhost")
        texts["refused"] = refused.text
        texts["refused job"] = json.dumps(await api.job(refused.json()["job_id"], "anyhost"))
        await asyncio.sleep(2.5)  # past the breaker's back-off
        leaky.replace_host_key()
        leaky.start()
        for _ in range(20):
            rekeyed = await api.submit({"host": "leaky", "argv": ["true"]}, sub="anyhost")
            if rekeyed.status_code == 502:
                break
            await asyncio.sleep(0.5)
        texts["host key"] = rekeyed.text
        texts["host key job"] = json.dumps(await api.job(rekeyed.json()["job_id"], "anyhost"))
    for name, text in texts.items():
        figure(f"SSH failure answer ({name})", text[:300])
    assert refused.status_code == 502 and rekeyed.status_code == 502
    assert rekeyed.json()["type"].endswith("host-key-mismatch")
    for name, text in texts.items():
        body = json.loads(text)
        said = " ".join(str(body.get(k, "")) for k in ("detail", "error", "title"))
        assert "leaky" in said, name
        leaked = [s for s in secrets_ if s in said]
        assert leaked == [], (name, said)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert leaky.username in logged


async def test_readers_see_only_their_own_pool_and_metrics_name_no_account(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Host `local` with two accounts (bob's `otheracct` is refused by sshd): alice's
    /v1/hosts/local shows one pool, hers, without its target; an admin sees both with their
    targets; /metrics labels pools by host name, never by user@host:port."""
    rule = f"""[[policy]]
subject = "bob"
issuer = "*"
hosts = ["local"]
[policy.accounts.local]
username = "otheracct"
client_keys = ["{tuned_host.client_key}"]

"""
    text = config_toml(tuned_host, secret_file, keys)
    path = tmp_path / "accounts.toml"
    path.write_text(text.replace('[[policy]]\nsubject = "*"', rule + '[[policy]]\nsubject = "*"'))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        assert (await api.submit({"host": "local", "argv": ["true"]}, sub="bob")).status_code == 502
        assert (await api.submit({"host": "local", "argv": ["true"]})).status_code == 201
        mine = await api.client.get(f"{api.url}/v1/hosts/local", headers=api.auth())
        listed = await api.client.get(f"{api.url}/v1/hosts", headers=api.auth())
        admin = await api.client.get(f"{api.url}/v1/hosts/local", headers=api.auth("ops", "admin"))
        metrics = (await api.client.get(f"{api.url}/metrics")).text
    pool_lines = [line for line in metrics.splitlines() if line.startswith("sshpool_")]
    figure("/v1/hosts/local for a reader: pools shown, bytes", (len(mine.json()["pool"]),
           len(mine.content)))  # fmt: skip
    figure("/metrics sshpool sample", pool_lines[:2])
    for answer in (mine, listed):
        assert "otheracct" not in answer.text and tuned_host.username not in answer.text
    assert len(mine.json()["pool"]) == 1 and "target" not in mine.json()["pool"][0]
    assert mine.json()["pool"][0]["counters"]["commands"] == 1
    assert sorted(p["target"].split("@")[0] for p in admin.json()["pool"]) == sorted(
        ["otheracct", tuned_host.username]
    )
    assert pool_lines and all("@" not in line for line in pool_lines)
    assert any(line.startswith('sshpool_connections{host="local"}') for line in pool_lines)
    # Nor the standard families (OTel's pool name is the host name), nor any other line.
    assert "otheracct" not in metrics and tuned_host.username not in metrics
    assert 'ssh_client_connection_count{ssh_client_connection_pool_name="local"' in metrics


async def test_unencodable_strings_nul_and_long_subjects_are_4xx_on_every_store(
    api_any_store: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """Lone surrogates (argv, stdin, command, template parameter) are 422; NUL or junk in a job
    id is 404 on every job route; NUL in the `host` filter is 422; a `sub` over 512
    characters or holding NUL is 401. Never a 500, and no SQL in answers or logs, on SQLite
    and PostgreSQL."""
    api = api_any_store
    caplog.set_level(logging.WARNING)
    headers = {**api.auth("anyhost"), "Content-Type": "application/json"}
    bodies = [
        b'{"host": "local", "argv": ["echo", "\\ud800"]}',
        b'{"host": "local", "argv": ["cat"], "stdin": "x\\udfff"}',
        b'{"host": "local", "command": "echo \\ud83d"}',
        b'{"host": "local", "template": "greet", "params": {"count": 1, "word": "\\ud800"}}',
        b'{"host": "local\\ud800", "argv": ["true"]}',
    ]
    seen: dict[str, int] = {}
    for n, raw in enumerate(bodies):
        r = await api.client.post(f"{api.url}/v1/jobs", content=raw, headers=headers)
        seen[f"surrogate body {n}"] = r.status_code
        assert r.status_code == 422, (raw, r.text)
    for job_id in ("%00", "a%00b", "01a2053c-1c8d-7cb1-a872-d1f72475378%00", "x" * 300):
        for method, path in (
            ("GET", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/output"),
            ("DELETE", f"/v1/jobs/{job_id}"),
        ):
            r = await api.client.request(method, f"{api.url}{path}", headers=headers)
            seen[f"{method} {path[:40]}"] = r.status_code
            assert r.status_code == 404, (method, path, r.text)
    r = await api.client.get(f"{api.url}/v1/jobs?host=lo%00cal", headers=headers)
    seen["host filter with NUL"] = r.status_code
    assert r.status_code == 422, r.text
    for sub in ("s" * 513, "nul\0sub"):
        token = api.token(sub)
        r = await api.client.get(f"{api.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
        seen[f"sub {sub[:8]!r}"] = r.status_code
        assert r.status_code == 401, r.text
    figure("surrogates / NUL / long sub: statuses", seen)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "SELECT" not in logged and "Traceback" not in logged


async def test_output_reads_of_one_identity_are_rate_limited(api: Api) -> None:
    """`slow` (rate 0.2/s, burst 2) reads a finished job's output 10 times in a row: 2 reads
    are served, 8 are 429 with Retry-After (a batch job's read would run SSH commands; the
    batch case is in test_api_batch.py)."""
    r = await api.submit({"host": "local", "argv": ["echo", "hi"]}, sub="slow")
    assert r.status_code == 201, r.text
    headers = api.auth("slow")
    url = f"{api.url}/v1/jobs/{r.json()['id']}/output"
    statuses = [(await api.client.get(url, headers=headers)).status_code for _ in range(10)]
    figure("10 output reads, rate 0.2 burst 2: statuses", statuses)
    assert statuses == [200, 200] + [429] * 8
