"""Jobs through real HTTP and a real sshd, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import time

from api_helpers import Api, eventually

from sshpool.devhost import LocalHost


async def test_submit_returns_201_with_the_result(api_any_store: Api) -> None:
    """A short command finishes within the default wait: 201, output, exit status, Location."""
    api = api_any_store
    r = await api.submit({"host": "local", "argv": ["echo", "hello world"]})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "succeeded"
    assert job["stdout"] == "hello world\n"
    assert job["exit_status"] == 0
    assert job["owner"] == "alice"
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert set(job["timings"]) >= {"queue", "connect", "open", "exec"}


async def test_nonzero_exit_is_state_failed(api_any_store: Api) -> None:
    """A command that exits non-zero is a finished job in state `failed` with its stderr."""
    r = await api_any_store.submit({"host": "local", "command": "echo oops >&2; exit 3"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["state"], job["exit_status"], job["stderr"]) == ("failed", 3, "oops\n")


async def test_wait_zero_answers_202_then_poll_finds_the_result(api_any_store: Api) -> None:
    """Prefer: wait=0 answers 202 at once with Location; polling it reaches `succeeded`."""
    api = api_any_store
    r = await api.submit({"host": "local", "command": "sleep 0.5; echo late"}, wait=0)
    assert r.status_code == 202, r.text
    assert r.json()["state"] in ("queued", "running")
    assert r.headers["Preference-Applied"] == "wait=0"
    job_id = r.json()["id"]
    assert r.headers["Location"] == f"/v1/jobs/{job_id}"
    job = await api.until_final(job_id)
    assert (job["state"], job["stdout"]) == ("succeeded", "late\n")


async def test_wait_elapses_then_202_while_the_job_runs(api_any_store: Api) -> None:
    """A command longer than Prefer: wait gets 202 after about `wait` seconds, state running."""
    api = api_any_store
    start = time.monotonic()
    r = await api.submit({"host": "local", "command": "sleep 3"}, wait=1)
    elapsed = time.monotonic() - start
    assert r.status_code == 202, r.text
    # Answered before the job's end (state running: the 3 s sleep goes on) and not before
    # the wait; how soon after the wait is the box's load, not asserted.
    assert r.json()["state"] == "running"
    assert elapsed >= 0.9
    await api.client.delete(f"{api.url}/v1/jobs/{r.json()['id']}", headers=api.auth())


async def test_list_is_newest_first_and_pages_with_a_cursor(api_any_store: Api) -> None:
    """GET /v1/jobs lists the caller's jobs newest first; next_cursor walks every page once."""
    api = api_any_store
    ids = []
    for n in range(5):
        r = await api.submit({"host": "local", "argv": ["echo", str(n)]}, sub="lister")
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    await api.submit({"host": "local", "argv": ["true"]}, sub="someone-else")
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        r = await api.client.get(f"{api.url}/v1/jobs", params=params, headers=api.auth("lister"))
        assert r.status_code == 200, r.text
        body = r.json()
        seen += [j["id"] for j in body["items"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))
    assert pages == 3


async def test_list_filters_by_state_and_host(api_any_store: Api) -> None:
    """?state= and ?host= narrow the list."""
    api = api_any_store
    await api.submit({"host": "local", "argv": ["true"]}, sub="filter")
    await api.submit({"host": "local", "argv": ["false"]}, sub="filter")
    h = api.auth("filter")
    r = await api.client.get(f"{api.url}/v1/jobs", params={"state": "failed"}, headers=h)
    assert [j["argv"] for j in r.json()["items"]] == [["false"]]
    r = await api.client.get(f"{api.url}/v1/jobs", params={"host": "tiny"}, headers=h)
    assert r.json()["items"] == []


async def test_cancel_kills_the_remote_process_tree(
    api_any_store: Api, tuned_host: LocalHost
) -> None:
    """DELETE on a running job answers `cancelled` and the remote processes (a child and a
    grandchild) are gone; a second DELETE is 409."""
    api = api_any_store
    marker = f"{time.time_ns() % 10**6 + 4_000_000}"
    line = f"sleep {marker}1 & sh -c 'sleep {marker}2'; wait"
    r = await api.submit({"host": "local", "command": line}, wait=0)
    job_id = r.json()["id"]
    # The two sleeps (child and grandchild); the unanchored pattern also finds the shells.
    await eventually(lambda: len(tuned_host.processes(f"^sleep {marker}")) == 2)
    r = await api.client.delete(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    await eventually(lambda: not tuned_host.processes(f"sleep {marker}"))
    r = await api.client.delete(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert (await api.until_final(job_id))["state"] == "cancelled"


async def test_cancel_of_a_finished_job_is_409(api_any_store: Api) -> None:
    """A job that already finished cannot be cancelled."""
    api = api_any_store
    job_id = (await api.submit({"host": "local", "argv": ["true"]})).json()["id"]
    r = await api.client.delete(f"{api.url}/v1/jobs/{job_id}", headers=api.auth())
    assert r.status_code == 409
    assert r.json()["type"].endswith("job-finished")


async def test_idempotency_key_replays_the_same_job(api_any_store: Api) -> None:
    """Same key and body: the same job, not a second run (the counter file grows once)."""
    api = api_any_store
    path = f"/tmp/sshapi-idem-{time.time_ns()}"
    body = {"host": "local", "command": f"echo x >> {path}; wc -l < {path}"}
    first = await api.submit(body, key="k-1")
    second = await api.submit(body, key="k-1")
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] == second.json()["id"]
    assert second.json()["stdout"].strip() == "1"
    assert second.headers["Idempotent-Replayed"] == "true"
    await api.submit({"host": "local", "argv": ["rm", "-f", path]})


async def test_idempotency_key_with_another_body_is_422(api_any_store: Api) -> None:
    """Reusing a key for a different request is refused and names the original job."""
    api = api_any_store
    first = await api.submit({"host": "local", "argv": ["echo", "a"]}, key="k-2")
    r = await api.submit({"host": "local", "argv": ["echo", "b"]}, key="k-2")
    assert r.status_code == 422
    assert r.json()["type"].endswith("idempotency-key-reused")
    assert r.json()["job_id"] == first.json()["id"]


async def test_idempotency_keys_are_scoped_to_their_owner(api_any_store: Api) -> None:
    """Another user's identical key and body make a job of their own."""
    api = api_any_store
    body = {"host": "local", "argv": ["echo", "mine"]}
    a = await api.submit(body, key="shared-key", sub="alice")
    b = await api.submit(body, key="shared-key", sub="bob")
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert b.json()["owner"] == "bob"


async def test_another_users_job_is_404_but_admin_sees_it(api_any_store: Api) -> None:
    """GET and DELETE on someone else's job are 404 (not 403); an admin token sees it."""
    api = api_any_store
    job_id = (await api.submit({"host": "local", "argv": ["true"]}, sub="alice")).json()["id"]
    url = f"{api.url}/v1/jobs/{job_id}"
    assert (await api.client.get(url, headers=api.auth("mallory"))).status_code == 404
    assert (await api.client.delete(url, headers=api.auth("mallory"))).status_code == 404
    r = await api.client.get(url, headers=api.auth("ops", "admin"))
    assert r.status_code == 200 and r.json()["owner"] == "alice"
    r = await api.client.get(f"{api.url}/v1/jobs", headers=api.auth("ops", "admin"))
    assert job_id in [j["id"] for j in r.json()["items"]]


async def test_timeout_kills_the_command_and_reports_timed_out(
    api_any_store: Api, tuned_host: LocalHost
) -> None:
    """A command past its timeout ends as `timed_out` with its partial output; it is killed."""
    api = api_any_store
    marker = f"{time.time_ns() % 10**6 + 5_000_000}"
    r = await api.submit({"host": "local", "command": f"echo begun; sleep {marker}", "timeout": 1})
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["state"], job["stdout"]) == ("timed_out", "begun\n")
    await eventually(lambda: not tuned_host.processes(f"sleep {marker}"))


async def test_cancel_right_after_a_202_cancels(api_any_store: Api) -> None:
    """A DELETE sent as soon as the 202 arrives (job possibly still queued) cancels it."""
    api = api_any_store
    r = await api.submit({"host": "local", "command": "sleep 30"}, wait=0)
    assert r.status_code == 202
    d = await api.client.delete(f"{api.url}/v1/jobs/{r.json()['id']}", headers=api.auth())
    assert d.status_code == 200, d.text
    assert d.json()["state"] == "cancelled"


async def test_concurrent_requests_with_one_idempotency_key_make_one_job(
    api_any_store: Api,
) -> None:
    """Five simultaneous submissions with the same key and body: one job, five equal answers,
    and the command ran once (the four that lost the insert answer as its replay and launch
    nothing)."""
    api = api_any_store
    path = f"/tmp/sshapi-race-{time.time_ns()}"
    body = {"host": "local", "command": f"echo x >> {path}"}
    answers = await asyncio.gather(*(api.submit(body, key="race") for _ in range(5)))
    assert {r.status_code for r in answers} == {201}
    assert len({r.json()["id"] for r in answers}) == 1
    listed = await api.client.get(f"{api.url}/v1/jobs", headers=api.auth())
    assert len(listed.json()["items"]) == 1
    ran = await api.submit({"host": "local", "command": f"cat {path}; rm -f {path}"})
    assert ran.json()["stdout"] == "x\n"
