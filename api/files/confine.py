"""Confinement: where a caller's paths may lead on a host, over one held SFTP session.

A policy rule gives `file_roots` per host pattern (none: no file access). The roots
are resolved on the host once per host, account and rule (SFTP realpath: `~`, `{account}`,
`{sub}` substituted, symlinks followed; `Confinements` keeps them), then each caller's path:

- read-like operations (stat, list, download, checksum) resolve the whole path with realpath,
  symlinks followed, and act on the *resolved* path;
- name-changing operations (upload, mkdir, delete, move) resolve the parent directory and act
  on `<resolved parent>/<basename>`: the final component is never followed (a symlink there is
  removed or renamed itself, and an upload onto one is refused);

and the resolved path must be a root or lie under one, else 403 `outside-roots`. A path that
does not resolve is judged by where it would lead (`Files._physical`), so neither a 404 nor a
403 tells what exists outside the roots. Writes never touch the host's protected paths (~/.ssh,
shell start-up files: 403 `protected-path`), and move/delete never act on a root or what holds
one (403 `root-refused`). Residual race: the account itself (a job of the same user) could swap
a directory of an already resolved path for a symlink between the check and the use; nobody
"""

from __future__ import annotations

import contextlib
import posixpath
import re
from collections import OrderedDict
from dataclasses import dataclass

from api.auth import Principal
from api.files.errors import outside, protected, root_refused
from api.policy import Grant
from api.problems import Problem
from sshpool import FileAttrs, RemoteFileError, RemoteNotFound, SFTPSession

MAX_PATH = 4096
# The longest name (one path component) Linux filesystems take, in bytes.
NAME_MAX = 255
# Symlinks followed when judging where a path that does not resolve would lead.
SYMLINK_HOPS = 8
# Prefixes of a path that does not resolve asked about together (`Files._physical`): one round
# trip for a path of up to this many names, a few for the longest a caller may give.
PREFIX_PROBES = 16
# Confinements (home and roots per host, account and rule) kept at most; the oldest go first.
MAX_CONFINEMENTS = 10_000
SUB_SAFE = re.compile(r"^[A-Za-z0-9@._+-]{1,128}$")


def _within(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _holds(path: str, others: list[str]) -> bool:
    """`path` is one of `others` or an ancestor of one."""
    return any(o == path or o.startswith(path.rstrip("/") + "/") for o in others)


def _check_path(given: str) -> str:
    if not given or len(given) > MAX_PATH or "\0" in given:
        raise Problem(422, "invalid-path", "Invalid path", f"1 to {MAX_PATH} characters, no NUL")
    try:
        encoded = given.encode()
    except UnicodeEncodeError:
        raise Problem(422, "invalid-path", "Invalid path", "not valid UTF-8") from None
    if len(encoded) > MAX_PATH:
        raise Problem(422, "invalid-path", "Invalid path", f"at most {MAX_PATH} bytes in UTF-8")
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise Problem(
            422,
            "name-too-long",
            "A name in the path is too long",
            f"at most {NAME_MAX} bytes per name in UTF-8 (the host's NAME_MAX)",
        )
    return given


@dataclass(slots=True)
class Place:
    """A confined location on the host: `path` is what operations use (resolved)."""

    given: str
    path: str


@dataclass(slots=True)
class Root:
    """One file root on the host, in the three forms a path can take to reach it."""

    # The pattern expanded (`~`, `{account}`, `{sub}`), absolute and normalised.
    written: str
    # Its parent resolved, its own name kept: what a name operation (move, delete) acts on.
    named: str
    # Its realpath, what paths must lie under; None while it does not exist.
    resolved: str | None

    @property
    def forms(self) -> list[str]:
        return [f for f in (self.written, self.named, self.resolved) if f is not None]


@dataclass(slots=True)
class Confinement:
    """An account's home and one rule's roots on one host, resolved once per configuration
    (FileService keeps them): a root re-resolved per request would follow whatever its path
    points to at that moment, a symlink swapped by a move included."""

    home: str
    roots: list[Root]
    # The host's protected paths, lexical and resolved; None until the first write needs them.
    protected: list[str] | None = None


class Files:
    """One caller's file operations on one host, over one held SFTP session."""

    def __init__(
        self, fs: SFTPSession, grant: Grant, who: Principal, confinement: Confinement
    ) -> None:
        self.fs = fs
        self.grant = grant
        self.who = who
        self.confinement = confinement

    @property
    def home(self) -> str:
        return self.confinement.home

    @property
    def roots(self) -> list[str]:
        return [r.resolved for r in self.confinement.roots if r.resolved is not None]

    @staticmethod
    async def confine(
        fs: SFTPSession, grant: Grant, who: Principal, patterns: list[str]
    ) -> Confinement:
        """The home and the roots of `patterns` resolved on the host."""
        home = await fs.realpath(".")
        found = Confinement(home, [])
        written = [w for p in patterns if (w := _expand(home, p, grant, who)) is not None]
        parents = await fs.realpaths([posixpath.dirname(w) for w in written])
        for path, parent in zip(written, parents, strict=True):
            base = posixpath.basename(path)
            named = posixpath.join(parent, base) if base and parent is not None else path
            found.roots.append(Root(path, named, None))
        await Files.resolve_roots(fs, found)
        return found

    @staticmethod
    async def resolve_roots(fs: SFTPSession, found: Confinement) -> None:
        """Resolve the roots not resolved yet. A root that does not exist (yet) confines nothing
        and is looked up again at the next request; once it exists it is kept as resolved."""
        for root in found.roots:
            if root.resolved is None:
                with contextlib.suppress(RemoteFileError):
                    real = await fs.realpath(root.written)
                    with contextlib.suppress(RemoteFileError):
                        await fs.stat(real)  # OpenSSH resolves a missing last name too
                        root.resolved = real

    def _absolute(self, path: str) -> str:
        return _absolute(self.home, path)

    async def resolve(self, given: str) -> Place:
        """The whole path resolved (symlinks followed), confined."""
        absolute = self._absolute(_check_path(given))
        try:
            real = await self.fs.realpath(absolute)
        except RemoteFileError:
            # Missing, or a directory on the way the account may not search: either way, the
            # answer must not depend on what exists outside the roots.
            await self._judge_missing(given, absolute)
            raise
        if not _within(real, self.roots):
            raise outside(given)
        return Place(given, real)

    async def resolve_name(self, given: str) -> Place:
        """The parent resolved and confined, the final component kept as it is (not followed)."""
        absolute = self._absolute(_check_path(given))
        parent, base = posixpath.split(absolute)
        if base in ("", ".", ".."):
            if absolute in self.roots or not _within(absolute, self.roots):
                raise outside(given)
            raise Problem(422, "invalid-path", "Invalid path", "the path must name an entry")
        try:
            real_parent = await self.fs.realpath(parent)
        except RemoteFileError:
            where = await self._judge_missing(given, parent)
            # Every caller of this one writes: a protected path is refused as such, whether
            # or not its parent exists yet.
            await self.guard(Place(given, posixpath.join(where, base)))
            raise
        path = posixpath.join(real_parent, base)
        if not _within(path, self.roots):
            raise outside(given)
        return Place(given, path)

    async def _judge_missing(self, given: str, absolute: str) -> str:
        """For a path that does not resolve (a missing component on the way): 403 when it
        would lead outside the roots, so a 404 never depends on what exists outside them;
        else where it would lead."""
        where = await self._physical(absolute, SYMLINK_HOPS)
        if where is None or not _within(where, self.roots):
            raise outside(given)
        return where

    async def _physical(self, path: str, hops: int) -> str | None:
        """Where `path` (absolute, normalised) leads, as if its missing components existed as
        plain directories: the longest prefix that resolves (a search asking PREFIX_PROBES
        prefixes at once per round: one round trip up to that depth, three at the deepest), a
        dangling symlink right after it followed, the rest appended. None after `hops` symlinks
        (a loop)."""
        parts = [p for p in path.split("/") if p]
        if not parts:
            return "/"
        # The whole path does not resolve (why we are here); parts[:low] does, to `real`. Each
        # round asks about up to PREFIX_PROBES prefixes between low and high at once.
        low, high, real = 0, len(parts) - 1, "/"
        while low < high:
            step = -(-(high - low) // PREFIX_PROBES)
            lengths = sorted({min(low + i * step, high) for i in range(1, PREFIX_PROBES + 1)})
            answers = await self.fs.realpaths(["/" + "/".join(parts[:n]) for n in lengths])
            for length, answer in zip(lengths, answers, strict=True):
                if answer is None:
                    high = length - 1
                    break
                low, real = length, answer
        following = posixpath.join(real, parts[low])
        rest = parts[low + 1 :]
        try:
            attrs = await self.fs.lstat(following)
        except RemoteFileError:
            return posixpath.normpath(posixpath.join(following, *rest))
        if attrs.type != "symlink":
            return posixpath.normpath(posixpath.join(following, *rest))
        if hops == 0:
            return None
        try:
            target = await self.fs.readlink(following)
        except RemoteFileError:
            return None
        led = posixpath.normpath(posixpath.join(real, target, *rest))
        try:
            return await self.fs.realpath(led)
        except RemoteFileError:
            return await self._physical(led, hops - 1)

    async def lstat(self, place: Place) -> FileAttrs | None:
        try:
            return await self.fs.lstat(place.path)
        except RemoteNotFound:
            return None

    async def guard(self, place: Place, *, holding: bool = False) -> None:
        """403 protected-path when `place` is, or lies in, one of the host's protected paths
        (with `holding`, also when it holds one: a move of a directory would bring its
        contents there, or take them away). Judged on the resolved path, so `..` and symlinks
        on the way do not get around it; the protected paths are resolved too (a `.bashrc`
        that is a link into a dotfiles repository protects its target)."""
        found = self.confinement.protected
        if found is None:
            found = await self._protected_paths()
            self.confinement.protected = found
        path = place.path
        if _within(path, found) or (holding and _holds(path, found)):
            raise protected(place.given)

    async def _protected_paths(self) -> list[str]:
        """Each protected path as written and as resolved: asked about all at once (an
        identity's first write on a long path waits for a few round trips, not one per path)."""
        found: list[str] = []
        lexicals = [posixpath.join(self.home, e) for e in self.grant.host.protected_paths]
        resolved = await self.fs.realpaths(lexicals)
        for lexical, real in zip(lexicals, resolved, strict=True):
            found.append(lexical)
            if real is None:
                real = await self._physical(lexical, SYMLINK_HOPS)
            if real is not None and real != lexical:
                found.append(real)
        return found

    def guard_roots(self, place: Place, what: str) -> None:
        """403 root-refused when `place` is a root or holds one, in any of its forms: as
        written (a symlink that is a root's path included), as a name operation sees it, as
        resolved."""
        forms = [f for root in self.confinement.roots for f in root.forms]
        if _holds(place.path, forms):
            raise root_refused(place.given, what)


def _expand(home: str, pattern: str, grant: Grant, who: Principal) -> str | None:
    if "{sub}" in pattern and not SUB_SAFE.match(who.subject):
        return None  # a subject with '/' or '..' must never widen a root
    if who.subject in (".", ".."):
        return None
    root = pattern.replace("{sub}", who.subject)
    root = root.replace("{account}", grant.target.username)
    return _absolute(home, root)


def _absolute(home: str, path: str) -> str:
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    elif not path.startswith("/"):
        path = f"{home}/{path}"
    return posixpath.normpath(path)


class Confinements:
    """The home and roots per host, account and rule (and subject, when a root names it),
    resolved on the first request and kept for the life of the process: a restart (a new
    configuration) resolves them again. A root that does not exist yet is looked up again at
    each request until it does. At most MAX_CONFINEMENTS, the least recently used go first."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str, tuple[str, ...], str], Confinement] = OrderedDict()

    async def get(
        self, fs: SFTPSession, grant: Grant, who: Principal, patterns: list[str]
    ) -> Confinement:
        subject = who.subject if any("{sub}" in p for p in patterns) else ""
        key = (grant.host_name, str(grant.target), tuple(patterns), subject)
        found = self._kept.get(key)
        if found is None:
            found = await Files.confine(fs, grant, who, patterns)
            self._kept[key] = found
            while len(self._kept) > MAX_CONFINEMENTS:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
            if any(r.resolved is None for r in found.roots):
                await Files.resolve_roots(fs, found)
        return found
