"""Hostile input against caps, policy and secrets (issue 15, items 7-11, 15, 17): each test
reproduces one way around a limit through the real API (real sshd, real Slurm, Redis,
PostgreSQL) and checks it is closed."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jwt
import pytest
import redis.asyncio as aioredis
from api_helpers import (
    KEYS_ISS,
    LOCAL_ISS,
    REDIS_URL,
    SSHAPI,
    Api,
    Keys,
    config_toml,
    free_port,
    make_settings,
    replicas,
    running_api,
)
from pydantic import ValidationError

import api as api_pkg
from api.config import load_config
from api.local import LOCAL_ISSUER as LOCAL_ISSUER_NAME
from api.policy import render
from api.problems import Problem
from api.quota import PREFIX
from loadtests.server import wait_ready
from sshpool.devhost import LocalHost, LocalSlurm, Rig, RigSpec

pytestmark = pytest.mark.timeout(180)

SCHEDULER = """
[hosts.local.scheduler]
poll_interval = 0.3
max_poll_interval = 1.0
settle = 1.0
"""


def with_rule(text: str, rule: str) -> str:
    """The test configuration with `rule` tried before the catch-all rule."""
    marker = '[[policy]]\nsubject = "*"'
    assert marker in text
    return text.replace(marker, rule + "\n" + marker)


# ---- item 7: batch jobs count against max_concurrent until final


async def test_batch_jobs_count_against_the_concurrent_cap_until_final_across_replicas(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Cap 8: of 12 batch jobs sent to two replicas 8 are accepted and 4 get 429; a command
    job is 429 too while they are active; once one batch job finishes its slot is free."""
    sub = f"cap-{uuid.uuid4().hex[:8]}"
    rule = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "cap-*"
hosts = ["local"]
shell_hosts = ["local"]
rate = 1000
burst = 1000
max_concurrent = 8
"""
    path = tmp_path / "cap.toml"
    path.write_text(with_rule(config_toml(slurm_host, secret_file, keys, SCHEDULER), rule))

    def job(seconds: int) -> dict[str, object]:
        script = f"#!/bin/sh\nsleep {seconds}\n"
        return {"host": "local", "batch": {"script": script, "workdir": workdir}}

    accepted: list[str] = []
    async with replicas(tmp_path, path, keys, secret, REDIS_URL) as (a, b):
        try:
            codes = []
            # The first job ends soon by itself; the others would run for five minutes.
            for n in range(12):
                r = await (a, b)[n % 2].submit(job(2 if n == 0 else 300), sub=sub)
                codes.append(r.status_code)
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                else:
                    assert r.json()["type"].endswith(":too-many-jobs"), r.text
            assert codes == [202] * 8 + [429] * 4
            # Submitted (sbatch answered) and still pending or running: they still count.
            for job_id in accepted:
                await a.wait_state(job_id, ("queued", "running"), sub=sub)
            r = await b.submit({"host": "local", "argv": ["true"]}, sub=sub)
            assert r.status_code == 429, r.text
            # A finished batch job frees its slot, on either replica.
            done = await a.until_final(accepted[0], sub=sub, timeout=60)
            assert done["state"] == "succeeded"
            r = await b.submit({"host": "local", "argv": ["true"]}, sub=sub)
            assert r.status_code == 201, r.text
        finally:
            for job_id in accepted[1:]:
                await a.client.delete(f"{a.url}/v1/jobs/{job_id}", headers=a.auth(sub))
            r = aioredis.from_url(REDIS_URL)
            for kind in ("rate", "active"):
                await r.delete(f"{PREFIX}{kind}:{LOCAL_ISS}\0{sub}")
            await r.aclose()


async def test_batch_job_cancelled_frees_its_slot(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """Cap 1: a pending/running batch job blocks a second one; cancelling it frees the slot."""
    rule = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "one-batch"
hosts = ["local"]
shell_hosts = ["local"]
max_concurrent = 1
"""
    path = tmp_path / "one.toml"
    path.write_text(with_rule(config_toml(slurm_host, secret_file, keys, SCHEDULER), rule))
    body = {"host": "local", "batch": {"script": "#!/bin/sh\nsleep 300\n", "workdir": workdir}}
    settings = make_settings(tmp_path, path, "sqlite", None)
    async with running_api(settings, keys, secret) as api:
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 202, r.text
        first = r.json()["id"]
        await asyncio.sleep(0.5)  # sbatch has answered: the job left the submit step
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 429, r.text
        r = await api.client.delete(f"{api.url}/v1/jobs/{first}", headers=api.auth("one-batch"))
        assert r.status_code == 200, r.text
        r = await api.submit(body, sub="one-batch")
        assert r.status_code == 202, r.text
        await api.client.delete(
            f"{api.url}/v1/jobs/{r.json()['id']}", headers=api.auth("one-batch")
        )


# ---- item 8: rules name their issuer; issuers grant only the scopes they list


def test_policy_rule_without_issuer_fails_to_load_with_a_clear_message(tmp_path: Path) -> None:
    """A rule written for `alice` with no issuer would match every IdP's alice: refused."""
    path = tmp_path / "noissuer.toml"
    path.write_text('[[issuers]]\nissuer = "a"\naudience = "x"\n\n[[policy]]\nsubject = "alice"\n')
    with pytest.raises(ValidationError) as refused:
        load_config(path)
    assert "policy rule for subject 'alice' has no `issuer`" in str(refused.value)


async def test_a_rule_for_one_issuers_alice_does_not_match_another_issuers_alice(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Rule (test-local, alice-a) grants host `secret`; test-keys' alice-a gets the catch-all
    rule, which does not: 403 there, 201 for the right issuer's alice-a."""
    rule = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "alice-a"
hosts = ["secret"]
"""
    path = tmp_path / "issuers.toml"
    path.write_text(with_rule(config_toml(tuned_host, secret_file, keys), rule))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        body = {"host": "secret", "argv": ["true"]}
        r = await api.submit(body, sub="alice-a")
        assert r.status_code == 201, r.text
        other = api.token("alice-a", iss=KEYS_ISS, key=api.keys.rsa, alg="RS256")
        r = await api.client.post(
            f"{api.url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {other}"}
        )
        assert r.status_code == 403, r.text
        assert r.json()["type"].endswith(":host-forbidden")


async def test_an_issuer_without_admin_in_its_scopes_cannot_grant_admin(api: Api) -> None:
    """test-keys lists no `admin`: its token claiming admin sees neither host `secret` nor
    another user's job; test-local's admin token sees both."""
    r = await api.submit({"host": "local", "argv": ["true"]}, sub="victim")
    job_id = r.json()["id"]
    claimed = api.token("mallory", "admin jobs:read", iss=KEYS_ISS, key=api.keys.rsa, alg="RS256")
    headers = {"Authorization": f"Bearer {claimed}"}
    r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=headers)
    assert r.status_code == 404, r.text
    r = await api.client.get(f"{api.url}/v1/hosts", headers=headers)
    assert "secret" not in {h["name"] for h in r.json()}
    r = await api.client.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth("ops", "admin"))
    assert r.status_code == 200, r.text


# ---- item 9: one secret per HS issuer, checked like the environment secret


def issuer_toml(name: str, algorithms: str, extra: str = "") -> str:
    return f'[[issuers]]\nissuer = "{name}"\naudience = "x"\nalgorithms = {algorithms}\n{extra}\n'


def strong_secret(path: Path, mode: int = 0o600) -> Path:
    path.write_text(secrets.token_urlsafe(48))
    path.chmod(mode)
    return path


def test_hs_issuer_other_than_the_local_one_needs_its_own_secret_file(tmp_path: Path) -> None:
    """An HS issuer without secret_file would be checked with the local secret, so whoever
    runs `sshapi token` could sign as it: refused at load; the local issuer may do without."""
    path = tmp_path / "c.toml"
    path.write_text(issuer_toml("https://idp.example", '["HS256"]'))
    with pytest.raises(ValidationError, match="needs its own secret_file"):
        load_config(path)
    path.write_text(issuer_toml(LOCAL_ISSUER_NAME, '["HS256"]'))
    assert load_config(path).issuers[0].secret_file is None


def test_two_hs_issuers_sharing_one_secret_file_are_refused(tmp_path: Path) -> None:
    """Two HS issuers on one secret file: a token of one verifies as the other."""
    secret = strong_secret(tmp_path / "s")
    extra = f'secret_file = "{secret}"'
    path = tmp_path / "c.toml"
    path.write_text(issuer_toml("a", '["HS256"]', extra) + issuer_toml("b", '["HS256"]', extra))
    with pytest.raises(ValidationError, match="secret_file of its own"):
        load_config(path)


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        ("12345", 0o600, "at least 32 bytes"),
        ("changeme", 0o600, "placeholder"),
        (None, 0o640, "readable by others"),
        (None, 0o604, "readable by others"),
    ],
)
def test_weak_or_readable_secret_files_are_refused_at_load(
    tmp_path: Path, content: str | None, mode: int, says: str
) -> None:
    """A 5-byte, placeholder, or group/world-readable secret_file fails the start."""
    secret = strong_secret(tmp_path / "s", mode)
    if content is not None:
        secret.write_text(content)
    path = tmp_path / "c.toml"
    path.write_text(issuer_toml("a", '["HS256"]', f'secret_file = "{secret}"'))
    with pytest.raises(ValidationError, match=says):
        load_config(path)


def test_an_issuer_mixing_hs_and_asymmetric_algorithms_is_refused(
    tmp_path: Path, keys: Keys
) -> None:
    """HS256 beside RS256 on one issuer: whoever holds the secret signs as the IdP."""
    secret = strong_secret(tmp_path / "s")
    extra = f'secret_file = "{secret}"\npublic_keys = ["{keys.files[0]}"]'
    path = tmp_path / "c.toml"
    path.write_text(issuer_toml("a", '["RS256", "HS256"]', extra))
    with pytest.raises(ValidationError, match="mixes HS and asymmetric"):
        load_config(path)


async def test_a_token_signed_with_the_hs_secret_is_refused_for_the_asymmetric_issuer(
    api: Api,
) -> None:
    """The running server: a token naming test-keys (asymmetric) signed with the HS secret is
    401."""
    forged = api.token("mallory", iss=KEYS_ISS)
    r = await api.client.get(f"{api.url}/v1/jobs", headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code == 401


def rule_without_issuer(tmp_path: Path) -> str:
    """A policy rule naming no issuer (item 8)."""
    return '[[issuers]]\nissuer = "a"\naudience = "x"\n\n[[policy]]\nsubject = "*"\n'


def five_byte_secret_file(tmp_path: Path) -> str:
    """An HS issuer whose secret_file holds 5 bytes (item 9)."""
    weak = tmp_path / "weak"
    weak.write_text("12345")
    weak.chmod(0o600)
    return issuer_toml("a", '["HS256"]', f'secret_file = "{weak}"')


@pytest.mark.parametrize(
    ("configuration", "says"),
    [
        pytest.param(rule_without_issuer, "has no `issuer`", id="rule-without-issuer"),
        pytest.param(five_byte_secret_file, "at least 32 bytes", id="five-byte-secret-file"),
    ],
)
def test_sshapi_serve_with_a_bad_configuration_exits_2_saying_why(
    tmp_path: Path, configuration: Callable[[Path], str], says: str
) -> None:
    """`sshapi serve` with such a file exits 2 with the reason, no traceback."""
    path = tmp_path / "c.toml"
    path.write_text(configuration(tmp_path))
    env = {**os.environ, "SSHAPI_CONFIG": str(path), "SSHAPI_DATA_DIR": str(tmp_path / "d")}
    done = subprocess.run([SSHAPI, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr


# ---- item 10: the rendered element, not the first placeholder, decides


async def test_empty_first_placeholder_cannot_smuggle_an_option(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """Template ["ls", "{dir}{name}"] with dir="" and name="-la" would run `ls -la`: 422."""
    extra = """
[templates.ls_in]
argv = ["ls", "{dir}{name}"]
[templates.ls_in.params.dir]
type = "str"
[templates.ls_in.params.name]
type = "str"
"""
    path = tmp_path / "ls.toml"
    path.write_text(config_toml(tuned_host, secret_file, keys, extra))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        body = {"host": "local", "template": "ls_in", "params": {"dir": "", "name": "-la"}}
        r = await api.submit(body)
        assert r.status_code == 422, r.text
        assert r.json()["type"].endswith(":invalid-param")
        body["params"] = {"dir": "/", "name": "tmp"}
        r = await api.submit(body)
        assert (r.status_code, r.json()["state"]) == (201, "succeeded")


# ---- item 11: a rule can make templates the only way in; the example's patterns hold


async def test_program_allowlist_and_templates_only_rules(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """`programs = ["printf"]`: printf runs, `sh -c` is 403. `programs = []`: argv is 403,
    templates still run, and a batch script (a shell script) is 403 without shell_hosts."""
    rules = f"""[[policy]]
issuer = "{LOCAL_ISS}"
subject = "listed"
hosts = ["local"]
programs = ["printf", "squeue"]

[[policy]]
issuer = "{LOCAL_ISS}"
subject = "templated"
hosts = ["local"]
programs = []
templates = ["greet"]
"""
    path = tmp_path / "programs.toml"
    path.write_text(with_rule(config_toml(slurm_host, secret_file, keys, SCHEDULER), rules))
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        r = await api.submit({"host": "local", "argv": ["printf", "ok"]}, sub="listed")
        assert (r.status_code, r.json().get("stdout")) == (201, "ok"), r.text
        for argv in (["sh", "-c", "id"], ["/usr/bin/printf", "x"], ["env", "printf", "x"]):
            r = await api.submit({"host": "local", "argv": argv}, sub="listed")
            assert r.status_code == 403, r.text
            assert r.json()["type"].endswith(":program-forbidden")

        r = await api.submit({"host": "local", "argv": ["true"]}, sub="templated")
        assert r.status_code == 403 and r.json()["type"].endswith(":program-forbidden")
        r = await api.submit({"host": "local", "command": "id"}, sub="templated")
        assert r.status_code == 403 and r.json()["type"].endswith(":shell-forbidden")
        batch = {"script": "#!/bin/sh\nid\n", "workdir": workdir}
        r = await api.submit({"host": "local", "batch": batch}, sub="templated")
        assert r.status_code == 403 and r.json()["type"].endswith(":shell-forbidden")
        body = {"host": "local", "template": "greet", "params": {"count": 2, "word": "hi"}}
        r = await api.submit(body, sub="templated")
        assert (r.status_code, r.json().get("stdout")) == (201, "<2|hi>"), r.text


def test_example_tail_log_pattern_refuses_dot_dot_segments() -> None:
    """The example config's tail_log accepted /scratch/../etc/passwd; its pattern now refuses
    any '.'-led segment and still takes an ordinary path."""
    config = load_config(Path(api_pkg.__file__).parent / "sshapi.example.toml")
    template = config.templates["tail_log"]
    for path in ("/scratch/../etc/passwd", "/scratch/a/../../etc/passwd", "/scratch/./x"):
        with pytest.raises(Problem) as refused:
            render("tail_log", template, {"path": path})
        assert refused.value.status == 422
    argv = render("tail_log", template, {"path": "/scratch/alice/run-1.log"})
    assert argv[-1] == "/scratch/alice/run-1.log"


# ---- item 15: dev mode keeps its data private


def test_dev_mode_data_dir_is_0700_and_its_database_and_secret_0600(tmp_path: Path) -> None:
    """`sshapi dev` with a data dir left 0755 and a jwt_secret left 0644: both are tightened at
    start (logged), the local host still answers a job, and jobs.sqlite3 with its -wal and
    -shm files are 0600, so the local host's account cannot read other users' outputs."""
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "jwt_secret").write_text(secrets.token_urlsafe(48))
    (data / "jwt_secret").chmod(0o644)
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "info"}
    log = tmp_path / "dev.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [SSHAPI, "dev", "--port", str(port)], env=env, stdout=sink, stderr=sink
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url)
            token = subprocess.run(
                [SSHAPI, "token", "--sub", "dev"], env=env, capture_output=True, text=True
            ).stdout.strip()
            r = httpx.post(
                f"{url}/v1/jobs",
                json={"host": "local", "argv": ["echo", "hi"]},
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            assert (r.status_code, r.json()["stdout"]) == (201, "hi\n"), r.text
            modes = {
                p.name: stat.S_IMODE(p.stat().st_mode)
                for p in data.iterdir()
                if p.name.startswith(("jobs.sqlite3", "jwt_secret"))
            }
            assert stat.S_IMODE(data.stat().st_mode) == 0o700
            assert set(modes) >= {"jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"}
            assert set(modes.values()) == {0o600}, modes
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    text = log.read_text()
    assert f"tightening {data} " in text and f"tightening {data / 'jwt_secret'}" in text


# ---- item 17: batch fields and output paths, `sshapi token`


async def batch_output(api: Api, job_id: str, sub: str = "alice") -> httpx.Response:
    return await api.client.get(f"{api.url}/v1/jobs/{job_id}/output", headers=api.auth(sub))


async def test_env_name_with_a_trailing_newline_is_422(api: Api) -> None:
    """`re.match` with `$` let "FOO\\n" through as an environment variable name."""
    body = {"host": "local", "batch": {"script": "#!/bin/sh\ntrue\n", "env": {"FOO\n": "x"}}}
    r = await api.submit(body)
    assert r.status_code == 422, r.text
    assert "env name" in r.text


async def test_sbatch_chdir_in_the_script_does_not_hide_the_output(
    slurm_host: LocalHost,
    workdir: str,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """A script with `#SBATCH --chdir` and no `workdir`: /output still finds its output."""
    path = tmp_path / "chdir.toml"
    path.write_text(config_toml(slurm_host, secret_file, keys, SCHEDULER))
    script = f"#!/bin/sh\n#SBATCH --chdir={workdir}\necho moved-$(pwd)\n"
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        r = await api.submit({"host": "local", "batch": {"script": script}})
        assert r.status_code == 202, r.text
        job = await api.until_final(r.json()["id"], timeout=60)
        assert job["state"] == "succeeded", job
        r = await batch_output(api, job["id"])
        assert (r.status_code, r.text) == (200, f"moved-{workdir}\n"), r.text


@pytest.fixture
def tcsh_slurm_host(slurm: LocalSlurm, tmp_path: Path) -> Iterator[LocalHost]:
    """A Slurm login host whose account logs in with tcsh."""
    tcsh = shutil.which("tcsh")
    if tcsh is None:
        pytest.fail("tcsh is missing: `make test` installs it", pytrace=False)
    spec = RigSpec("tcsh-login", "tuned", shell=tcsh, overrides=slurm.sshd_overrides())
    with Rig(spec, data_dir=tmp_path / "hosts") as rig:
        yield rig.host


async def test_batch_output_reads_back_under_tcsh_with_a_bang_in_workdir(
    tcsh_slurm_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> None:
    """tcsh expands `!` even inside single quotes: a workdir holding one must still give the
    job's output back (and its exit code) through the API."""
    work = tmp_path / "out!dir"
    work.mkdir()
    account = tcsh_slurm_host.account
    os.chown(work, account.uid, account.gid)
    for directory in (work.parent, *work.parent.parents):
        directory.chmod(directory.stat().st_mode | 0o111)
    path = tmp_path / "tcsh.toml"
    path.write_text(config_toml(tcsh_slurm_host, secret_file, keys, SCHEDULER))
    body = {
        "host": "local",
        "batch": {"script": "#!/bin/sh\necho from-tcsh\nexit 3\n", "workdir": str(work)},
    }
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as api:
        r = await api.submit(body)
        assert r.status_code == 202, r.text
        job = await api.until_final(r.json()["id"], timeout=60)
        assert (job["state"], job["exit_status"]) == ("failed", 3), job
        r = await batch_output(api, job["id"])
        assert (r.status_code, r.text) == (200, "from-tcsh\n"), r.text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sub", "x", "--ttl", "inf"], "--ttl"),
        (["--sub", "x", "--ttl", "nan"], "--ttl"),
        (["--sub", "x", "--ttl", "0"], "--ttl"),
        (["--sub", "x", "--ttl", str(31 * 86400)], "30 days"),
        (["--sub", ""], "--sub"),
        (["--sub", "   "], "--sub"),
    ],
)
def test_sshapi_token_refuses_unbounded_ttls_and_empty_subjects(
    tmp_path: Path, args: list[str], says: str
) -> None:
    """`sshapi token --ttl inf` was a traceback; a year-long TTL or an empty --sub were minted.
    Each is now a usage error (exit 2) naming the option, with no traceback."""
    env = {**os.environ, "SSHAPI_DATA_DIR": str(tmp_path / "d")}
    env.pop("SSHAPI_CONFIG", None)
    done = subprocess.run(
        [SSHAPI, "token", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout
    assert says in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_sshapi_token_mints_up_to_the_cap(tmp_path: Path) -> None:
    """30 days is accepted, and the token says so."""
    env = {**os.environ, "SSHAPI_DATA_DIR": str(tmp_path / "d")}
    env.pop("SSHAPI_CONFIG", None)
    done = subprocess.run(
        [SSHAPI, "token", "--sub", "x", "--ttl", str(30 * 86400)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    claims = jwt.decode(done.stdout.strip(), options={"verify_signature": False})
    assert claims["exp"] - claims["iat"] == 30 * 86400
