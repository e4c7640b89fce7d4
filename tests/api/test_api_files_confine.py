"""What the files API can never do, whatever the roots: plant code that sshd or a login shell
runs (`~/.ssh`, shell start-up files), widen or delete a root, tell what exists outside the
roots; and the upload's own rules under concurrency and with odd names.

The host is this machine and its account's home is shared by every test of the session: a test
that writes near the start-up files restores what it found (and writes only harmless bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from api_helpers import (
    REDIS_URL,
    Api,
    Keys,
    config_toml,
    eventually,
    host_toml,
    make_settings,
    running_api,
)

from api.config import Config, load_config
from sshpool.devhost import LocalHost

POLICY = """
[[policy]]
subject = "tpl-*"
issuer = "*"
hosts = ["local"]
programs = []
shell_hosts = []
templates = ["greet"]
file_roots = { "*" = ["~"] }
allow_writes_on_templates_account = true
rate = 1000
burst = 1000

[[policy]]
subject = "fc-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}/work", "~/sshapi-files/{sub}/work/shared"] }
rate = 1000
burst = 1000

[[policy]]
subject = "up-*"
issuer = "*"
hosts = ["local"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
rate = 1000
burst = 1000

[[policy]]
subject = "one-*"
issuer = "*"
hosts = ["local", "down"]
file_roots = { "*" = ["~/sshapi-files/{sub}"] }
max_transfers = 1
rate = 1000
burst = 1000

[[policy]]
subject = "nofiles-*"
issuer = "*"
hosts = ["local"]
rate = 1000
burst = 1000

"""
RW = "files:read files:write"
HARMLESS = b"# written by an sshapi test: never kept\n"


def write_config(tuned_host: LocalHost, secret_file: Path, keys: Keys, tmp_path: Path) -> Path:
    text = config_toml(tuned_host, secret_file, keys).replace(
        "[[policy]]", POLICY + "[[policy]]", 1
    )
    path = tmp_path / "sshapi.toml"
    path.write_text(text)
    return path


@pytest.fixture
async def api(
    tuned_host: LocalHost, secret_file: Path, secret: str, keys: Keys, tmp_path: Path
) -> AsyncIterator[Api]:
    path = write_config(tuned_host, secret_file, keys, tmp_path)
    async with running_api(make_settings(tmp_path, path, "sqlite", None), keys, secret) as running:
        yield running


class Caller:
    def __init__(self, api: Api, host: LocalHost, prefix: str, sub: str | None = None) -> None:
        self.api = api
        self.sub = sub or f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.home = Path(host.account.home)
        self.dir = self.home / "sshapi-files" / self.sub
        self.headers = api.auth(self.sub, RW)
        self.base = f"{api.url}/v1/hosts/local/files"

    async def put(self, path: str | Path, data: bytes, **headers: str) -> httpx.Response:
        return await self.api.client.put(
            f"{self.base}/content",
            params={"path": str(path)},
            content=data,
            headers={**self.headers, **headers},
        )

    async def get(self, path: str | Path) -> httpx.Response:
        return await self.api.client.get(
            f"{self.base}/content", params={"path": str(path)}, headers=self.headers
        )

    async def meta(self, path: str | Path) -> httpx.Response:
        return await self.api.client.get(
            self.base, params={"path": str(path)}, headers=self.headers
        )

    async def mkdir(self, path: str | Path) -> httpx.Response:
        return await self.api.client.post(
            f"{self.base}/mkdir", json={"path": str(path)}, headers=self.headers
        )

    async def move(
        self, source: str | Path, destination: str | Path, overwrite: bool = False
    ) -> httpx.Response:
        body = {"source": str(source), "destination": str(destination), "overwrite": overwrite}
        return await self.api.client.post(f"{self.base}/move", json=body, headers=self.headers)

    async def delete(self, path: str | Path) -> httpx.Response:
        return await self.api.client.delete(
            self.base, params={"path": str(path)}, headers=self.headers
        )


def caller(api: Api, host: LocalHost, prefix: str) -> Iterator[Caller]:
    c = Caller(api, host, prefix)
    host.run_local(["mkdir", "-p", str(c.dir)])
    try:
        yield c
    finally:
        subprocess.run(["rm", "-rf", str(c.dir)], check=False)


@pytest.fixture
def tpl(api: Api, tuned_host: LocalHost) -> Iterator[Caller]:
    yield from caller(api, tuned_host, "tpl")


@pytest.fixture
def fc(api: Api, tuned_host: LocalHost) -> Iterator[Caller]:
    yield from caller(api, tuned_host, "fc")


@pytest.fixture
def up(api: Api, tuned_host: LocalHost) -> Iterator[Caller]:
    yield from caller(api, tuned_host, "up")


@pytest.fixture
def one(api: Api, tuned_host: LocalHost) -> Iterator[Caller]:
    yield from caller(api, tuned_host, "one")


@pytest.fixture
def startup_files(tuned_host: LocalHost) -> Iterator[Path]:
    """The account's home, its start-up files as found put back afterwards (whatever a broken
    API did to them), and whatever a test created among them removed."""
    home = Path(tuned_host.account.home)
    watched = [".ssh", ".bashrc", ".profile", ".config", ".local"]
    saved = {n: (home / n).read_bytes() for n in watched if (home / n).is_file()}
    absent = [n for n in watched if not (home / n).exists() and not (home / n).is_symlink()]
    try:
        yield home
    finally:
        for name in absent:
            p = home / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        for name, data in saved.items():
            p = home / name
            if p.is_symlink() or p.is_dir():
                p.unlink() if p.is_symlink() else shutil.rmtree(p)
            if not p.exists() or p.read_bytes() != data:
                p.write_bytes(data)
                os.chown(p, tuned_host.account.uid, tuned_host.account.gid)


def refused(r: httpx.Response, kind: str = "protected-path") -> bool:
    return r.status_code == 403 and r.json()["type"].endswith(kind)


async def test_a_templates_only_identity_cannot_plant_startup_files(
    tpl: Caller, startup_files: Path, tuned_host: LocalHost
) -> None:
    """A templates-only identity with files:write and the whole home as its root cannot create
    ~/.ssh/rc or replace ~/.bashrc: not directly, not through `..`, not through a symlinked
    directory inside its root, not by moving a file or a directory there, not by moving the
    real ones away. Each answer is 403 `protected-path`; nothing appears, nothing changes."""
    home = startup_files
    bashrc = (home / ".bashrc").read_bytes()
    # Its argv and shell jobs are refused: templates only.
    r = await tpl.api.client.post(
        f"{tpl.api.url}/v1/jobs",
        json={"host": "local", "argv": ["true"]},
        headers=tpl.api.auth(tpl.sub),
    )
    assert r.status_code == 403, r.text
    assert refused(await tpl.mkdir("~/.ssh")), "mkdir ~/.ssh"
    assert refused(await tpl.mkdir(f"{tpl.dir}/../../.ssh")), "mkdir through .."
    assert refused(await tpl.put("~/.ssh/rc", HARMLESS)), "PUT ~/.ssh/rc"
    assert refused(await tpl.put("~/.bashrc", HARMLESS)), "PUT ~/.bashrc"
    assert refused(await tpl.put(f"{tpl.dir}/../../.bashrc", HARMLESS, **{"If-Match": "*"}))
    assert refused(await tpl.put("~/.config/fish/config.fish", HARMLESS))
    # A symlinked directory inside the root that leads to the home.
    tuned_host.run_local(["ln", "-s", str(home), str(tpl.dir / "h")])
    assert refused(await tpl.put(f"{tpl.dir}/h/.bashrc", HARMLESS, **{"If-None-Match": "*"}))
    assert refused(await tpl.put(f"{tpl.dir}/h/.profile", HARMLESS, **{"If-None-Match": "*"}))
    # Moves: a file onto a start-up file, a directory holding `rc` onto ~/.ssh, a directory
    # that would bring `fish/config.fish` to ~/.config, the real .bashrc away.
    assert (await tpl.put(f"{tpl.dir}/rc", HARMLESS)).status_code == 201
    assert refused(await tpl.move(f"{tpl.dir}/rc", "~/.bashrc"))
    assert (await tpl.mkdir(f"{tpl.dir}/dotssh")).status_code == 201
    assert (await tpl.put(f"{tpl.dir}/dotssh/rc", HARMLESS)).status_code == 201
    assert refused(await tpl.move(f"{tpl.dir}/dotssh", "~/.ssh"))
    assert refused(await tpl.move(f"{tpl.dir}/dotssh", f"{tpl.dir}/h/.ssh"))
    assert (await tpl.mkdir(f"{tpl.dir}/cfg")).status_code == 201
    assert (await tpl.mkdir(f"{tpl.dir}/cfg/fish")).status_code == 201
    assert refused(await tpl.move(f"{tpl.dir}/cfg", "~/.config"))
    assert refused(await tpl.move("~/.bashrc", f"{tpl.dir}/bashrc.moved"))
    assert refused(await tpl.delete("~/.bashrc"))
    assert not (home / ".ssh").exists() and not (home / ".config").exists()
    assert (home / ".bashrc").read_bytes() == bashrc
    # What is not a start-up file stays writable (the root is the whole home).
    assert (await tpl.put(f"{tpl.dir}/notes.txt", b"ok")).status_code == 201
    assert (await tpl.put(f"{tpl.dir}/.bashrc", b"not the home's")).status_code == 201


async def test_a_files_only_token_cannot_plant_code_in_pythons_user_site(
    tpl: Caller, startup_files: Path
) -> None:
    """A token with files scopes only and the whole home as its root cannot put a
    usercustomize.py or a .pth file into a Python user site (any version: each would run in
    every python3 the account starts), neither directly, nor by making the directories, nor by
    moving a directory that brings them: 403 `protected-path`; ~/.local beside it stays
    writable."""
    home = startup_files
    for version in ("3.6", "3.11", "3.13"):
        site = f"~/.local/lib/python{version}/site-packages"
        assert refused(await tpl.put(f"{site}/usercustomize.py", HARMLESS)), version
        assert refused(await tpl.put(f"{site}/sshapi.pth", HARMLESS)), version
    assert refused(await tpl.mkdir("~/.local/lib"))
    assert (await tpl.mkdir(f"{tpl.dir}/local")).status_code == 201
    assert (await tpl.mkdir(f"{tpl.dir}/local/lib")).status_code == 201
    assert refused(await tpl.move(f"{tpl.dir}/local", "~/.local"))
    assert (await tpl.mkdir("~/.local")).status_code in (201, 409)
    assert refused(await tpl.move(f"{tpl.dir}/local/lib", "~/.local/lib"))
    assert not list(home.glob(".local/lib/python3.*/site-packages/usercustomize.py"))
    assert (await tpl.put("~/.local/notes.txt", b"ok")).status_code == 201


async def test_move_and_delete_never_widen_or_remove_a_root(
    fc: Caller, tuned_host: LocalHost
) -> None:
    """The finding reproduced: roots `work` and `work/shared`, where `work/shared` is a symlink
    to `project-a`; `work/evil` is a symlink to `project-b` (outside). Moving `evil` onto
    `shared` (a root as written) is refused, so PROJECT-SECRET stays out of reach; a root (as
    written or resolved) and a directory holding one cannot be moved or deleted; a root
    swapped on the host after the first request keeps confining to what it resolved to."""
    d = fc.dir
    for sub in ("work", "project-a", "project-b"):
        tuned_host.run_local(["mkdir", "-p", str(d / sub)])
    tuned_host.run_local(["sh", "-c", f"echo PROJECT-SECRET > {d}/project-b/PROJECT-SECRET"])
    tuned_host.run_local(["ln", "-s", str(d / "project-a"), str(d / "work" / "shared")])
    tuned_host.run_local(["ln", "-s", str(d / "project-b"), str(d / "work" / "evil")])
    assert (await fc.put(f"{d}/work/shared/a.txt", b"a")).status_code == 201
    r = await fc.move(f"{d}/work/evil", f"{d}/work/shared", overwrite=True)
    assert refused(r, "root-refused"), r.text
    r = await fc.get(f"{d}/work/shared/PROJECT-SECRET")
    assert r.status_code in (403, 404) and b"PROJECT-SECRET" not in r.content, r.text
    assert refused(await fc.delete(f"{d}/work/shared"), "root-refused")
    assert refused(await fc.delete(f"{d}/project-a"), "root-refused")  # the root as resolved
    assert refused(await fc.move(f"{d}/work/shared", f"{d}/work/s2"), "root-refused")
    assert (d / "work" / "shared").is_symlink() and (d / "work" / "evil").is_symlink()
    # The account (a job, say) swaps the root's symlink: the API keeps the root it resolved.
    tuned_host.run_local(["ln", "-sfn", str(d / "project-b"), str(d / "work" / "shared")])
    r = await fc.get(f"{d}/work/shared/PROJECT-SECRET")
    assert refused(r, "outside-roots"), r.text
    r = await fc.put(f"{d}/work/shared/new.txt", b"x")
    assert refused(r, "outside-roots"), r.text
    assert not (d / "project-b" / "new.txt").exists()


async def test_a_symlink_never_tells_what_exists_outside_the_roots(
    fc: Caller, tuned_host: LocalHost
) -> None:
    """Symlinks inside the roots to outside paths that exist and that do not (a missing file,
    a missing directory, a chain of links, a directory the account may not search): the same
    403 `outside-roots` for every one, read or write."""
    d = fc.dir
    tuned_host.run_local(["mkdir", "-p", str(d / "work"), str(d / "out" / "there")])
    links = {
        "to-file": d / "out" / "there" / "f",
        "to-missing-file": d / "out" / "there" / "nope",
        "to-dir": d / "out" / "there",
        "to-missing-dir": d / "out" / "nope",
        "to-missing-deep": d / "out" / "nope" / "deeper" / "f",
        # Deeper than one round of prefix probes: where it leads takes several.
        "to-missing-deeper": d / "out" / "there" / Path(*(f"n{i}" for i in range(40))),
        "chain": d / "work" / "to-missing-dir",
        "to-unsearchable": Path("/root/x/y"),  # /root is 0700: the account may not look in
    }
    tuned_host.run_local(["touch", str(d / "out" / "there" / "f")])
    for name, target in links.items():
        tuned_host.run_local(["ln", "-s", str(target), str(d / "work" / name)])
    answers = {}
    for name in links:
        for what, r in (
            ("get", await fc.get(f"{d}/work/{name}")),
            ("stat", await fc.meta(f"{d}/work/{name}")),
            ("get-under", await fc.get(f"{d}/work/{name}/x/y")),
            ("put-under", await fc.put(f"{d}/work/{name}/x", b"x")),
            ("mkdir-under", await fc.mkdir(f"{d}/work/{name}/x/y")),
        ):
            answers[(name, what)] = (r.status_code, r.json()["type"].rsplit(":", 1)[-1])
    assert set(answers.values()) == {(403, "outside-roots")}, answers
    # Inside the roots a missing path is still 404.
    assert (await fc.get(f"{d}/work/missing/x")).status_code == 404
    assert (await fc.put(f"{d}/work/missing/x", b"x")).status_code == 404
    deep = "/".join(f"m{i}" for i in range(40))
    assert (await fc.put(f"{d}/work/{deep}/x", b"x")).status_code == 404


async def test_without_file_roots_a_rule_has_no_file_access(api: Api) -> None:
    """A rule that does not write `file_roots` gets no files at all: 403 files-forbidden."""
    headers = api.auth(f"nofiles-{uuid.uuid4().hex[:8]}", RW)
    r = await api.client.get(
        f"{api.url}/v1/hosts/local/files", params={"path": "~"}, headers=headers
    )
    assert refused(r, "files-forbidden"), r.text


def test_file_writes_beside_templates_only_users_are_refused_at_start(
    tuned_host: LocalHost, secret_file: Path, tmp_path: Path
) -> None:
    """A rule that may write files on an account that a templates-only rule also uses fails
    the start, naming both rules; not when they use different accounts, when no issuer may
    grant files:write, or when the rules say they mean it."""

    def config(scopes: str, uploader: str = "", account: str = "") -> Config:
        path = tmp_path / "sshapi.toml"
        path.write_text(
            f"""
[[issuers]]
issuer = "idp"
audience = "sshapi"
secret_file = "{secret_file}"
scopes = [{scopes}]
"""
            + host_toml("local", tuned_host)
            + f"""
[[policy]]
subject = "templates-only"
issuer = "*"
hosts = ["local"]
programs = []
templates = ["greet"]

[[policy]]
subject = "uploader"
issuer = "idp"
hosts = ["local"]
file_roots = {{ "local" = ["~/data"] }}
{uploader}
{account}
"""
        )
        return load_config(path)

    writes = '"jobs:read", "files:read", "files:write"'
    with pytest.raises(ValueError, match="templates") as caught:
        config(writes)
    assert "'uploader'" in str(caught.value) and "'templates-only'" in str(caught.value)
    assert isinstance(config(writes, "allow_writes_on_templates_account = true"), Config)
    assert isinstance(config('"jobs:read", "files:read"'), Config)
    own = f'[policy.accounts.local]\nusername = "other"\nclient_keys = ["{tuned_host.client_key}"]'
    assert isinstance(config(writes, account=own), Config)


async def upload_race(first: Caller, second: Caller, path: str, etag: str) -> list[int]:
    """Two uploads of the same size with the same If-Match, both past their first check (their
    temporary files exist) before either sends its last byte; their statuses."""
    go = asyncio.Event()
    home = Path(path).parent

    async def body(data: bytes) -> AsyncIterator[bytes]:
        yield data[:1]
        await go.wait()
        yield data[1:]

    async def put(c: Caller, data: bytes) -> httpx.Response:
        return await c.api.client.put(
            f"{c.base}/content",
            params={"path": path},
            content=body(data),
            headers={**c.headers, "If-Match": etag, "Content-Length": str(len(data))},
        )

    tasks = [asyncio.create_task(put(first, b"AAAA")), asyncio.create_task(put(second, b"BBBB"))]
    await eventually(lambda: len(list(home.glob(".*.sshapi-*.part"))) == 2)
    go.set()
    return sorted(r.status_code for r in await asyncio.gather(*tasks))


@pytest.mark.parametrize("where", ["one replica", "two replicas sharing Redis"])
async def test_two_uploads_with_one_if_match_never_both_succeed(
    where: str,
    tuned_host: LocalHost,
    secret_file: Path,
    secret: str,
    keys: Keys,
    tmp_path: Path,
) -> None:
    """The lost update: two uploads holding the same ETag, racing to replace the same version
    (of the same size, within the same second, so the ETags of the versions would collide),
    through one API process or through two that share Redis. One wins (200), the other gets
    412, and the file holds the winner's bytes; three rounds."""
    path = write_config(tuned_host, secret_file, keys, tmp_path)
    redis = REDIS_URL if where != "one replica" else None
    async with contextlib.AsyncExitStack() as stack:
        apis = []
        for name in ("a", "b") if redis else ("a",):
            settings = make_settings(tmp_path / name, path, "sqlite", None)
            settings = settings.model_copy(update={"replica": name, "redis_url": redis})
            apis.append(await stack.enter_async_context(running_api(settings, keys, secret)))
        first = stack.enter_context(contextlib.contextmanager(caller)(apis[0], tuned_host, "up"))
        second = Caller(apis[-1], tuned_host, "up", first.sub)  # the same identity elsewhere
        target = f"{first.dir}/f.txt"
        for _ in range(3):
            r = await first.put(target, b"0000")
            assert r.status_code in (200, 201), r.text
            assert await upload_race(first, second, target, r.headers["etag"]) == [200, 412]
            assert (first.dir / "f.txt").read_bytes() in (b"AAAA", b"BBBB")
            assert not list(first.dir.glob(".*.sshapi-*"))


async def test_if_match_star_modes_and_names(up: Caller, tuned_host: LocalHost) -> None:
    """`If-Match: *` replaces any existing file and refuses a missing one (412); a replaced
    file keeps its permission bits, a new one gets the account's default (0666 minus its
    umask: 0644 here); names of 240 bytes of emoji, with a newline or a backslash upload and
    read back; a name longer than NAME_MAX is 422 `name-too-long`, not a 409."""
    d = up.dir
    tuned_host.run_local(["sh", "-c", f"echo old > {d}/kept && chmod 640 {d}/kept"])
    r = await up.put(f"{d}/kept", b"new", **{"If-Match": "*"})
    assert r.status_code == 200, r.text
    assert (d / "kept").read_bytes() == b"new"
    assert oct((d / "kept").stat().st_mode & 0o7777) == oct(0o640)
    r = await up.put(f"{d}/missing", b"x", **{"If-Match": "*"})
    assert r.status_code == 412, r.text
    assert not (d / "missing").exists()
    assert (await up.put(f"{d}/fresh", b"x")).status_code == 201
    assert oct((d / "fresh").stat().st_mode & 0o7777) == oct(0o644)
    for name in ("\U0001f600" * 60, "line\nbreak", "back\\slash", "é" * 127):
        assert len(name.encode()) <= 255
        r = await up.put(f"{d}/{name}", name.encode())
        assert r.status_code == 201, (name, r.text)
        r = await up.get(f"{d}/{name}")
        assert r.status_code == 200 and r.content == name.encode(), name
    r = await up.put(f"{d}/{'é' * 128}", b"x")
    assert r.status_code == 422 and r.json()["type"].endswith("name-too-long"), r.text
    assert not [n for n in os.listdir(d) if ".sshapi-" in n]


async def test_transfer_cap_and_host_failures_say_what_they_are(one: Caller) -> None:
    """The transfer cap's 429 is `too-many-transfers` (not `too-many-jobs`); a file request on a
    host that is down names that host in its problem, not '?'."""
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"x"
        await release.wait()
        yield b"y"

    held = asyncio.create_task(
        one.api.client.put(
            f"{one.base}/content",
            params={"path": f"{one.dir}/slow"},
            content=slow(),
            headers={**one.headers, "Content-Length": "2"},
        )
    )
    try:
        await eventually(lambda: [n for n in os.listdir(one.dir) if ".sshapi-" in n])
        r = await one.put(f"{one.dir}/second", b"z")
        assert r.status_code == 429, r.text
        assert r.json()["type"].endswith("too-many-transfers"), r.text
        assert "retry-after" in r.headers
    finally:
        release.set()
        assert (await held).status_code == 201
    for _ in range(2):  # a refused connect, then the open breaker
        r = await one.api.client.get(
            f"{one.api.url}/v1/hosts/down/files", params={"path": "~"}, headers=one.headers
        )
        assert r.status_code in (502, 503), r.text
        assert "'down'" in r.json()["detail"] and "'?'" not in r.text, r.text
