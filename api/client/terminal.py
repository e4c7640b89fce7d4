"""What the client commands share (api/client/cli.py, api/client/files_cli.py): the common
options, the Client whose errors end a command in one line (exit 255, as ssh), and `printable`:
what the server hands back (file names, symlink targets, problem details, a job's command line
and error) could drive the terminal raw."""

from __future__ import annotations

import unicodedata
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from api.client import Client

Profile = Annotated[
    str | None,
    typer.Option(help="A profile of the client configuration file.", envvar="SSHAPI_PROFILE"),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]
ERROR_EXIT = 255
# Said when the server cannot be reached: where its URL comes from.
WHERE_FROM = (
    "the server's URL comes from SSHAPI_URL, else the url of a profile of the client "
    "configuration file (--profile, SSHAPI_PROFILE, its `default`; docs/client.md); "
    "`sshapi dev` prints the export line for its server"
)
# Characters a terminal acts on or that reorder what follows, besides the control characters
# (C0, DEL, C1): the bidi marks, embeddings, overrides and isolates, and the line and paragraph
# separators. Other format characters stay (the zero-width joiner is part of emoji).
INVISIBLE = frozenset(
    "\u061c\u200e\u200f"  # ALM, LRM, RLM
    "\u202a\u202b\u202c\u202d\u202e"  # LRE, RLE, PDF, LRO, RLO
    "\u2066\u2067\u2068\u2069"  # LRI, RLI, FSI, PDI
    "\u2028\u2029"  # line and paragraph separators
)


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char in INVISIBLE or unicodedata.category(char) in ("Cc", "Cs"):
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return char


def printable(text: str) -> str:
    """`text` with every character that could act on a terminal written as its escape
    (`\\x1b`, `\\u202e`; a backslash as two, so that no name reads as another)."""
    return "".join(map(_escaped, text))


def say(text: str, err: bool = False) -> None:
    """Print a line holding what the server sent, escaped (`printable`)."""
    typer.echo(printable(text), err=err)


@contextmanager
def client(profile: str | None) -> Iterator[Client]:
    """A Client; its errors end the command with a message on stderr and exit 255."""
    from api.client import Client, SshapiError, TransportError

    made: Client | None = None
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            made = Client(profile=profile)
        for warning in warned:
            say(f"sshapi: warning: {warning.message}", err=True)
        with made as c:
            yield c
    except TransportError as exc:
        say(f"sshapi: {exc}", err=True)
        if made is not None:
            say(f"sshapi: {made.url} came from {made.url_from}", err=True)
        say(f"sshapi: {WHERE_FROM}", err=True)
        raise typer.Exit(ERROR_EXIT) from None
    except SshapiError as exc:
        say(f"sshapi: {exc}", err=True)
        raise typer.Exit(ERROR_EXIT) from None
