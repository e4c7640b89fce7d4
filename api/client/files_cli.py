"""`sshapi files ...`: files on a host through the API (docs/files.md), with progress bars for
transfers; an error names its side and path (`HOST:PATH (remote)`, `PATH (local)`); `rm` and
`mkdir` of several paths go on past one that fails, report each and exit 1. The shared pieces
(`client`, `say`, `printable`) are api/client/cli.py's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from api.client.terminal import AsJson, Profile, client, printable, say

if TYPE_CHECKING:
    from api.client import Progress as OnProgress

files_app = typer.Typer(
    help="Files on a host (over SFTP, through the API).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

Host = Annotated[str, typer.Argument(help="A configured host name.")]


@contextmanager
def transfer(label: str, quiet: bool) -> Iterator[OnProgress]:
    """A progress bar on stderr (bytes, speed, time left) while a transfer runs; none when
    stderr is not a terminal or with --json."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
    ) as bar:
        task = bar.add_task(escape(printable(label)), total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@files_app.command("ls")
def files_ls(
    host: Host,
    path: Annotated[str, typer.Argument(help="A directory or file; relative: from home.")] = "~",
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """List a directory, or show one entry.

    Each entry's type, mode, size, modification time and name."""
    with client(profile) as c:
        if as_json:
            typer.echo(json.dumps(c.list_files(host, path), indent=2))
            return
        # Each page printed as it comes: a big directory shows its first entries at once.
        for answer in c.list_pages(host, path):
            for entry in answer.get("items", [answer]):
                name = str(entry.get("name") or entry.get("path") or "")
                if entry.get("target"):
                    name += f" -> {entry['target']}"
                # A 0-byte file's size is 0, not blank: only a missing field is blank.
                mode, size, mtime = (
                    "" if entry.get(k) is None else str(entry[k]) for k in ("mode", "size", "mtime")
                )
                say(f"{entry['type']:7} {mode:>6} {size:>12} {mtime:25} {name}")


@files_app.command("get")
def files_get(
    host: Host,
    path: Annotated[str, typer.Argument(help="The file on the host.")],
    dest: Annotated[
        Path | None, typer.Argument(help="Where to write it (default: its name, here).")
    ] = None,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Download a file. An interrupted download (`DEST.part`) resumes where it stopped."""
    target = dest if dest is not None else Path(path.rstrip("/").rsplit("/", 1)[-1])
    if target.is_dir():
        target = target / path.rstrip("/").rsplit("/", 1)[-1]
    with (
        client(profile) as c,
        sides(host, path, target),
        transfer(f"get {path}", as_json) as progress,
    ):
        try:
            size = c.download(host, path, target, progress=progress)
        except KeyboardInterrupt:
            part = target.with_name(f"{target.name}.part")
            kept = part.stat().st_size if part.exists() else 0
            typer.echo("", err=True)  # past the progress bar's line, or ^C
            say(
                f"sshapi: interrupted: {kept} bytes kept in {part}; the same `sshapi files get`"
                " again resumes from there",
                err=True,
            )
            raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps({"path": path, "dest": str(target), "size": size}))


@files_app.command("put")
def files_put(
    host: Host,
    source: Annotated[Path, typer.Argument(help="The local file.", exists=True, dir_okay=False)],
    path: Annotated[
        str | None, typer.Argument(help="Where on the host (default: its name, in home).")
    ] = None,
    create_only: Annotated[
        bool, typer.Option(help="Refuse to replace an existing file (412).")
    ] = False,
    parents: Annotated[
        bool, typer.Option("--parents", "-p", help="Create the missing directories of PATH.")
    ] = False,
    resumable: Annotated[
        bool,
        typer.Option(
            help="In 16 MiB chunks, each checked: a cut connection costs one chunk, and the "
            "same command run again after a stop goes on where the upload stood."
        ),
    ] = False,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Upload a file.

    Streamed; it appears on the host only once complete."""
    remote = path or source.name
    hint = "" if parents else " (--parents creates its directories)"
    with (
        client(profile) as c,
        sides(host, remote, source, hint),
        transfer(f"put {source.name}", as_json) as progress,
    ):
        send = c.upload_resumable if resumable else c.upload
        answer = send(
            host, source, remote, create_only=create_only, parents=parents, progress=progress
        )
    if as_json:
        typer.echo(json.dumps(answer))
    else:
        say(f"{answer['path']}  {answer['size']} bytes  sha256 {answer['sha256']}")


@files_app.command("mv")
def files_mv(
    host: Host,
    source: Annotated[str, typer.Argument(help="The file or directory to move.")],
    dest: Annotated[str, typer.Argument(help="Its new path (within your roots).")],
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing DEST (atomically), else 409.")
    ] = False,
    profile: Profile = None,
    as_json: AsJson = False,
) -> None:
    """Rename or move a file or directory on the host."""
    with client(profile) as c:
        answer = c.move(host, source, dest, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(answer))


@files_app.command("checksum")
def files_checksum(
    host: Host,
    paths: Annotated[list[str], typer.Argument(help="Files on the host.")],
    profile: Profile = None,
) -> None:
    """Print each file's sha256, computed on the host.

    Nothing is downloaded. As sha256sum prints it (`HASH  PATH`), to compare with `sha256sum`
    here. One that fails is reported and the others still computed; the exit status is 1 if
    any failed."""
    with client(profile) as c:
        failed = each(host, paths, lambda path: say(f"{c.checksum(host, path)}  {path}"))
    if failed:
        raise typer.Exit(1)


@files_app.command("rm")
def files_rm(
    host: Host,
    paths: Annotated[list[str], typer.Argument(help="Files, symlinks or empty directories.")],
    profile: Profile = None,
) -> None:
    """Delete files, symlinks (not their targets) or empty directories. One that fails is
    reported and the others are still deleted; the exit status is 1 if any failed."""
    with client(profile) as c:
        failed = each(host, paths, lambda path: c.delete_file(host, path))
    if failed:
        raise typer.Exit(1)


@files_app.command("mkdir")
def files_mkdir(
    host: Host,
    paths: Annotated[list[str], typer.Argument(help="Directories to create.")],
    parents: Annotated[
        bool,
        typer.Option(
            "--parents", "-p", help="Create missing parents too; an existing directory is fine."
        ),
    ] = False,
    profile: Profile = None,
) -> None:
    """Create directories. One that fails is reported and the others are still made; the exit
    status is 1 if any failed."""
    with client(profile) as c:
        failed = each(host, paths, lambda path: c.mkdir(host, path, parents=parents))
    if failed:
        raise typer.Exit(1)


def each(host: str, paths: list[str], act: Callable[[str], object]) -> int:
    """`act` on every path, going on past a path the server refuses (reported on stderr,
    naming it); how many failed. A refused token, like the server being unreachable, ends the
    command: every other path would fail the same way."""
    from api.client import ProblemError, Unauthorized

    failed = 0
    for path in paths:
        try:
            act(path)
        except Unauthorized:
            raise
        except ProblemError as exc:
            failed += 1
            say(f"sshapi: {host}:{path} (remote): {exc}", err=True)
    return failed


@contextmanager
def sides(host: str, remote: str, local: Path, hint: str = "") -> Iterator[None]:
    """A transfer's error names its side and path: the server's problem with the remote path
    (`hint` added to a 404), or the local file's OSError."""
    from api.client import ProblemError, SshapiError, Unauthorized

    try:
        yield
    except Unauthorized:
        raise
    except ProblemError as exc:
        extra = hint if exc.status == 404 else ""
        raise SshapiError(f"{host}:{remote} (remote): {exc}{extra}") from None
    except OSError as exc:
        raise SshapiError(f"{local} (local): {exc.strerror or exc}") from None
