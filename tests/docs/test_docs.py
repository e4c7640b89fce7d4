"""Every command in the docs is one a test runs or a link checker checks.

The docs are README.md and docs/*.md. Commands are the lines of fenced ```sh / ```bash blocks
(minus comments) and the `$ ` lines of ```console blocks (the other lines of a console block are
output). Each command is verified for real, by the kind of its program:

- `make X`: `make -n X` succeeds (the target exists and its recipe expands);
- `.venv/bin/sshapi SUB... --opt`: `sshapi SUB... --help` succeeds and lists every option used;
  `sshapi token` is also run, with a fresh data directory, and must print a token (both in this
  process, through the console script's typer app: tests/api/test_api_cli.py starts the script);
- `.venv/bin/python -m MOD ARGS`: `python -m MOD ARGS --help` succeeds (argparse parses the
  values given before it reaches --help) and lists every option used;
- `.venv/bin/locust -f FILE ARGS`: `locust -f FILE ARGS --list` succeeds: Locust parses the exact
  arguments, the locustfile's own included, then lists the user classes and exits (each in a
  process of its own, forked from one that imported Locust once for all of them);
- `.venv/bin/pytest PATHS`: each path exists;
- every command of docs/deploy.md: run, block by block, by tests/deploy/test_deploy_doc.py;
- `pip install sshapi` / `'sshapi[EXTRA]'`: pyproject.toml names the project `sshapi` and has
  that extra;
- `curl ...` (console blocks only): run against a real API that this test starts with
  `sshapi dev --slurm` (what `make run` does, plus Slurm for the batch example), with the token
  `sshapi token` mints for it in `$TOKEN` and its URL in `$SSHAPI_URL` (commands never name a
  port: `make run PORT=N` may have moved it); every curl shows its expected status
  (`HTTP/1.1 NNN` below it, with `-i`) or, when its output is captured (`NAME=$(curl -sf ...)`),
  must succeed and print something.

A command no check knows fails the test: rewrite the docs rather than show an unchecked command.
Python blocks must compile and their imports must resolve. Every relative link and #anchor in the
docs and RELIABILITY.md resolves. A failure names file:line and the command.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jwt
import pytest
from typer.testing import CliRunner

from api.cli import app as sshapi_app
from loadtests.server import wait_ready

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "RELIABILITY.md"]
# Help output must not be cut or boxed to the terminal's width.
HELP_ENV = {**os.environ, "COLUMNS": "300", "TERM": "dumb", "NO_COLOR": "1"}


@dataclass
class Command:
    path: Path
    line: int
    text: str  # one logical line: continuations joined, comments kept for the shell
    lang: str
    block: int  # index of the block within its file
    output: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    lines: list[str]


def blocks(path: Path) -> Iterator[Block]:
    fence: Block | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None:
            if m := re.match(r"^```(\S*)\s*$", line):
                fence = Block(path, number, m.group(1), [])
        elif line.startswith("```"):
            yield fence
            fence = None
        else:
            fence.lines.append(line)


def commands(path: Path) -> list[Command]:
    found: list[Command] = []
    for index, block in enumerate(blocks(path)):
        if block.lang not in ("sh", "bash", "console"):
            continue
        current: Command | None = None
        continuing = False  # the previous command line ended with a backslash
        for offset, line in enumerate(block.lines, 1):
            if continuing and current is not None:
                current.text += "\n" + line
            elif block.lang == "console" and not line.startswith("$ "):
                if current is not None:
                    current.output.append(line)
                continue
            elif block.lang == "console" or (line.strip() and not line.lstrip().startswith("#")):
                text = line[2:] if block.lang == "console" else line
                current = Command(path, block.line + offset, text, block.lang, index)
                found.append(current)
            else:
                continue
            continuing = line.rstrip().endswith("\\") or not complete(current.text)
    return found


def complete(text: str) -> bool:
    """False while a quote is still open: the command goes on on the next line."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def is_curl(command: Command) -> bool:
    return re.match(r"^([A-Za-z_][A-Za-z0-9_]*=\$\()?curl\s", command.text) is not None


ALL = [c for p in DOCS for c in commands(p)]
# docs/deploy.md's curl runs in its own test, against the deployment it builds.
CURL_BLOCKS = sorted({(c.path, c.block) for c in ALL if is_curl(c) and c.path.name != "deploy.md"})


def words(command: Command) -> list[str]:
    """The command's words, without comments, leading VAR=value assignments or a .venv/bin/."""
    argv = shlex.split(command.text.replace("\\\n", " "), comments=True)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv.pop(0)
    if argv and argv[0].startswith(".venv/bin/"):
        argv[0] = argv[0].removeprefix(".venv/bin/")
    return argv


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=HELP_ENV, **kwargs
    )


def options(argv: list[str]) -> list[str]:
    """The options used, up to a `--` (what follows is a remote command's argv: `sshapi run`)."""
    if "--" in argv:
        argv = argv[: argv.index("--")]
    return [a.split("=", 1)[0] for a in argv if re.match(r"^--?[A-Za-z]", a)]


def leading_words(argv: list[str]) -> list[str]:
    """Subcommands: the words before the first option."""
    subs = []
    for a in argv:
        if a.startswith("-"):
            break
        subs.append(a)
    return subs


def assert_listed(command: Command, used: list[str], help_text: str) -> None:
    missing = [o for o in used if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", help_text)]
    assert not missing, f"{command}\n  options not in its --help: {missing}"


def sshapi(args: list[str], env: dict[str, str | None]) -> tuple[int, str]:
    """`sshapi ARGS` in this process: its exit status and what it printed. The console script
    is `api.cli.main`, which runs this app; a process each cost ~0.3 s of imports per command."""
    result = CliRunner().invoke(sshapi_app, args, env=env)
    return result.exit_code, result.output


@functools.cache
def sshapi_help(subs: tuple[str, ...]) -> str:
    code, output = sshapi(
        [*subs, "--help"], {k: HELP_ENV[k] for k in ("COLUMNS", "TERM", "NO_COLOR")}
    )
    assert code == 0, f"sshapi {' '.join(subs)} --help failed:\n{output}"
    return output


def check_sshapi(command: Command, args: list[str], tmp_path: Path) -> None:
    subs = leading_words(args)
    assert subs, f"{command}\n  no sshapi subcommand"
    assert_listed(command, options(args), sshapi_help(tuple(subs)))
    if subs == ["token"]:
        # Cheap and side-effect free with a data dir of its own: run it.
        code, output = sshapi(
            args, {"SSHAPI_DATA_DIR": str(tmp_path / "data"), "SSHAPI_CONFIG": None}
        )
        assert code == 0, f"{command}\n  failed: {output}"
        token = output.strip()
        claims = jwt.decode(token, options={"verify_signature": False})
        assert claims["sub"] == args[args.index("--sub") + 1], f"{command}\n  printed {token!r}"


def module_help(module: str, args: list[str]) -> tuple[int, str, str]:
    """`python -m MODULE ARGS --help` in this process: (exit status, stdout, stderr). The
    module runs as `__main__` with that argv, as `python -m` would, and argparse exits at
    --help after parsing the values before it; in-process, the libraries the load suite
    imports (matplotlib, SQLAlchemy, asyncssh) load once for all the commands, not once each."""
    out, err = io.StringIO(), io.StringIO()
    argv, columns = sys.argv, os.environ.get("COLUMNS")
    # A `__main__` block may block or handle signals before its argparse runs (the rig's host
    # blocks SIGTERM for its sigwait): left so, every process this test run starts afterwards
    # would inherit the mask (sshd sessions, executors and servers deaf to SIGTERM).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    sys.argv = [module, *args, "--help"]
    os.environ["COLUMNS"] = HELP_ENV["COLUMNS"]
    code: int | str | None = 0
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            # A module another test imported runs again as `__main__`: a second copy, to parse
            # its arguments and print its help, which is all `--help` does.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        sys.argv = argv
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return (code if isinstance(code, int) else 1 if code else 0), out.getvalue(), err.getvalue()


def check_module(command: Command, argv: list[str]) -> None:
    assert argv[1] == "-m", f"{command}\n  only `python -m MODULE` commands are checked"
    module, args = argv[2], argv[3:]
    code, stdout, stderr = module_help(module, args)
    assert code == 0, f"{command}\n  `--help` failed: {stderr.strip()}"
    assert_listed(command, options(args), stdout)


# `locust ARGS --list` for each argv read (JSON) from stdin, each in a child forked from this
# process, which imported Locust (gevent, its web UI: ~1.5 s) once for all of them: the child
# runs Locust's own console script, `locust.main:main`, with that argv, as a fresh `locust`
# would. Prints [exit status, the end of stderr] per argv, as JSON.
LOCUST_LISTS = """\
import json, os, sys, tempfile, traceback
import locust.main
results = []
for argv in json.load(sys.stdin):
    sys.stdout.flush()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["locust", *argv, "--list"]
        code = 0
        try:
            locust.main.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1 if exc.code else 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), err.read().decode()[-500:]])
print(json.dumps(results))
"""
LOCUST_COMMANDS = [
    words(c)[1:]
    for c in ALL
    if c.path.name != "deploy.md" and not is_curl(c) and words(c)[:1] == ["locust"]
]


@functools.cache
def locust_lists() -> dict[tuple[str, ...], tuple[int, str]]:
    """`locust ARGS --list` of every locust command of the docs: (exit status, stderr's end)."""
    done = run([sys.executable, "-c", LOCUST_LISTS], input=json.dumps(LOCUST_COMMANDS))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    return {
        tuple(args): (code, err) for args, (code, err) in zip(LOCUST_COMMANDS, found, strict=True)
    }


def check_locust(command: Command, args: list[str]) -> None:
    assert args[:1] == ["-f"] and (ROOT / args[1]).is_file(), f"{command}\n  no locustfile"
    # --list parses every argument (the locustfile's own too), lists the users and exits.
    code, stderr = locust_lists()[tuple(args)]
    assert code == 0, f"{command}\n  locust refused it: {stderr.strip()}"


@functools.cache
def make_n(target: str) -> subprocess.CompletedProcess[str]:
    return run(["make", "-n", target])


def check_make(command: Command, args: list[str]) -> None:
    for target in args:
        done = make_n(target)  # `make run` is on three pages
        assert done.returncode == 0, f"{command}\n  make -n {target}: {done.stderr.strip()}"


def check_pytest(command: Command, args: list[str], config: pytest.Config) -> None:
    """Each test path exists; each marker a `-m` expression names is declared (a misspelt tier
    would select nothing, silently)."""
    paths, expressions = [], []
    values = iter(args)
    for a in values:
        if a in ("-m", "-k"):
            (expressions if a == "-m" else []).append(next(values, ""))
        elif not a.startswith("-"):
            paths.append(a)
    missing = [a for a in paths if not (ROOT / a).exists()]
    assert not missing, f"{command}\n  no such test paths: {missing}"
    declared = {line.split(":", 1)[0] for line in config.getini("markers")}
    for expression in expressions:
        names = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}
        assert names <= declared, f"{command}\n  undeclared markers: {names - declared}"


def check_pip(command: Command, args: list[str]) -> None:
    assert args[0] == "install", f"{command}\n  only `pip install` is checked"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in args[1:]:
        m = re.fullmatch(r"([\w.-]+)(?:\[([\w,-]+)\])?", spec)
        assert m and m.group(1) == project["name"], f"{command}\n  {spec} is not this project"
        for extra in (m.group(2) or "").split(",") if m.group(2) else []:
            assert extra in project["optional-dependencies"], f"{command}\n  no extra {extra}"


@pytest.mark.parametrize("command", [c for c in ALL if not is_curl(c)], ids=lambda c: c.where)
def test_command(command: Command, tmp_path: Path, pytestconfig: pytest.Config) -> None:
    if command.path.name == "deploy.md":
        # Run for real, in order, as root: tests/deploy/test_deploy_doc.py.
        assert (ROOT / "tests" / "deploy" / "test_deploy_doc.py").is_file()
        return
    argv = words(command)
    assert argv, f"{command}\n  empty command"
    program, args = argv[0], argv[1:]
    if program == "make":
        check_make(command, args)
    elif program == "sshapi":
        check_sshapi(command, args, tmp_path)
    elif program in ("python", "python3"):
        check_module(command, argv)
    elif program == "locust":
        check_locust(command, args)
    elif program == "pytest":
        check_pytest(command, args, pytestconfig)
    elif program == "pip":
        check_pip(command, args)
    else:
        pytest.fail(f"{command}\n  no check knows `{program}`: rewrite the docs")


# --------------------------------------------------------------------------------------------
# curl examples against a real API: `sshapi dev --slurm` on a free port, its own data dir.


@dataclass
class DevApi:
    url: str
    token: str
    env: dict[str, str]  # what its own `sshapi` commands need (its data dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def dev_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevApi]:
    data = tmp_path_factory.mktemp("dev") / "data"
    printed = data.parent / "dev.out"
    port = free_port()
    env = {**os.environ, "SSHAPI_DATA_DIR": str(data), "SSHAPI_LOG_LEVEL": "warning"}
    env.pop("SSHAPI_CONFIG", None)
    with printed.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "sshapi"), "dev", "--slurm", "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, timeout=120)
        # The token `make run` prints, as a reader pastes it: the files examples need it too.
        token = next(
            line.removeprefix("export TOKEN=")
            for line in printed.read_text().splitlines()
            if line.startswith("export TOKEN=")
        )
        yield DevApi(url, token, env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "where",
    CURL_BLOCKS,
    ids=lambda w: f"{w[0].relative_to(ROOT)}:block{w[1]}",
)
def test_curl_examples(where: tuple[Path, int], dev_api: DevApi) -> None:
    """Run a console block's commands in order, as a reader would paste them; variables a
    command assigns (`LOCATION=$(curl ...)`) carry to the next ones."""
    env = {**os.environ, "TOKEN": dev_api.token, "SSHAPI_URL": dev_api.url}
    for command in [c for c in ALL if (c.path, c.block) == where]:
        assert command.lang == "console", f"{command}\n  curl examples go in console blocks"
        script = command.text
        assignment = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=\$\(", script)
        if assignment:
            script += f'\nprintf %s "${assignment.group(1)}"'
        elif not is_curl(command):
            continue  # checked by test_command
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{command}\n  exit {done.returncode}: {done.stderr}"
        if assignment:
            assert done.stdout, f"{command}\n  assigned nothing"
            env[assignment.group(1)] = done.stdout
            continue
        statuses = [m.group(1) for o in command.output if (m := re.match(r"HTTP/1.1 (\d{3})", o))]
        assert statuses, f"{command}\n  a curl example must show its status (-i, HTTP/1.1 NNN)"
        got = done.stdout.splitlines()[0] if done.stdout else ""
        expected = f"HTTP/1.1 {statuses[0]}"
        assert got.startswith(expected), f"{command}\n  got {got!r}:\n{done.stdout}"


def test_the_doctor_example_is_what_doctor_prints(dev_api: DevApi) -> None:
    """docs/operations.md shows `sshapi doctor` against `sshapi dev --slurm`: the same checks and
    figures as it prints now, apart from what differs per run (ports, timings, the rig's path,
    the OpenSSH build)."""
    page = ROOT / "docs" / "operations.md"
    [example] = [c for c in commands(page) if words(c)[:2] == ["sshapi", "doctor"] and c.output]
    done = subprocess.run(
        [str(BIN / "sshapi"), "doctor"], env=dev_api.env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rig = str(Path(dev_api.env["SSHAPI_DATA_DIR"])) + "-hosts"

    def steady(line: str) -> str:
        line = line.replace(rig, "<repo>/.data-hosts")
        # A parallel worker's own rig account (tests/conftest.py), the docs' sshapi-hpc.
        line = re.sub(r"\bsshapi-hpc-gw\d+\b", "sshapi-hpc", line)
        line = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line)
        line = re.sub(r"\(SSH-2\.0-[^)]*\)", "(SSH-2.0-...)", line)
        line = re.sub(r"slurm-wlm [\d.]+", "slurm-wlm N", line)
        return re.sub(r"[\d.]+ ms", "N ms", line).rstrip()

    printed = [steady(o) for o in done.stdout.splitlines()]
    assert [steady(o) for o in example.output] == printed, done.stdout


@pytest.mark.parametrize("locustfile", ["burst", "sustained"])
def test_the_load_suite_options_are_documented_with_their_defaults(locustfile: str) -> None:
    """Locust's --help cannot show a locustfile's options (it prints before loading it): the
    table in docs/load-suite.md is their help, so it names every one with its default."""
    script = (
        f"import loadtests.{locustfile}\n"
        "from locust.argument_parser import get_parser\n"
        "for group in get_parser()._action_groups:\n"
        "    if group.title in ('sshapi load suite', 'burst', 'sustained'):\n"
        "        for a in group._group_actions:\n"
        "            d = a.default\n"
        "            d = ' '.join(map(str, d)) if isinstance(d, list) else d\n"
        "            print(a.option_strings[0], d, sep='\\t')\n"
    )
    done = run([sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    rows = (ROOT / "docs" / "load-suite.md").read_text().split("\n## Options\n", 1)[1]
    found = [line.split("\t") for line in done.stdout.splitlines()]
    assert len(found) > 10
    missing = [
        f"{option} (default {default})"
        for option, default in found
        if not re.search(rf"^\| `{option}` \|[^|]*\| `{re.escape(default)}` \|", rows, re.M)
    ]
    assert missing == []


# --------------------------------------------------------------------------------------------
# Python blocks compile and import what exists.


PYTHON_BLOCKS = [b for p in DOCS for b in blocks(p) if b.lang == "python"]


@pytest.mark.parametrize(
    "block", PYTHON_BLOCKS, ids=lambda b: f"{b.path.relative_to(ROOT)}:{b.line}"
)
def test_python_block_imports(block: Block) -> None:
    import ast
    import importlib

    where = f"{block.path.relative_to(ROOT)}:{block.line}"
    # `await` at top level is how the examples show a call inside a coroutine.
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    tree = compile("\n".join(block.lines), where, "exec", flags=flags)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


# --------------------------------------------------------------------------------------------
# Links and anchors.


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)$", line)):
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            yield number, m.group(1)


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path: Path) -> None:
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_index_links_every_page_and_the_readme_is_short() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in DOCS if p.parent.name == "docs" and p.name != "index.md"]
    assert [p for p in pages if f"]({p})" not in index] == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_no_command_names_a_fixed_api_port() -> None:
    """`make run PORT=N` moves the API: commands say `$SSHAPI_URL`, which it prints."""
    port = re.compile(r"(127\.0\.0\.1|localhost):8000")
    fixed = [str(c) for c in ALL if any(port.search(w) for w in words(c))]
    assert fixed == []


def test_every_command_is_checked() -> None:
    """The extraction itself: the docs do show commands, and console output is not taken for one."""
    assert len(ALL) > 20
    assert not [c for c in ALL if c.text.startswith(("HTTP/", "{", "export "))]


# --------------------------------------------------------------------------------------------
# What renders and what is cited.


def table_cells(row: str) -> int:
    """A table row's cell count: pipes inside code spans or escaped do not separate cells."""
    text = re.sub(r"`[^`]*`", "x", row.strip()).replace("\\|", "x")
    return len(text.strip("|").split("|"))


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_render_as_tables(path: Path) -> None:
    """A table is a header, a `|---|` row, then rows of as many cells, after a blank line: rows
    pasted under a paragraph or another section render as pipe text."""
    lines = path.read_text().splitlines()
    broken, fenced, start = [], False, None
    for number, line in enumerate([*lines, ""], 1):
        if line.startswith("```"):
            fenced = not fenced
        is_row = not fenced and line.lstrip().startswith("|")
        if is_row and start is None:
            start = number
        elif not is_row and start is not None:
            table = lines[start - 1 : number - 1]
            where = f"{path.relative_to(ROOT)}:{start}"
            if start > 1 and lines[start - 2].strip():
                broken.append(f"{where}: no blank line before the table")
            if len(table) < 2 or not re.fullmatch(
                r"\|?( *:?-+:? *\|)+( *:?-+:? *)?", table[1].strip()
            ):
                broken.append(f"{where}: no |---| row under the header")
            widths = {table_cells(row) for row in table}
            if len(widths) > 1:
                broken.append(f"{where}: rows of {sorted(widths)} cells")
            start = None
    assert not broken, "\n".join(broken)


def tracked() -> set[str]:
    done = run(["git", "ls-files"])
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines())


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_cites_a_file_outside_the_repository(path: Path) -> None:
    """A reader must be able to open what a page cites. A path in backticks that starts with one
    of the repository's top-level names exists; every Markdown file named (prose or code) is one
    of the repository's, or a report the load suite writes (its name is in loadtests/)."""
    files = tracked()
    tops = {f.split("/")[0] for f in files}
    names = {Path(f).name for f in files if f.endswith(".md")}
    suite = "".join(p.read_text() for p in (ROOT / "loadtests").glob("*.py"))
    missing = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for m in re.finditer(r"`([\w.-]+/[^`\s]*)`", line):
            cited = re.split(r"[#:]| ", m.group(1))[0].rstrip("/.,")
            placeholder = re.search(r"[*<>{}]", cited)
            if cited.split("/")[0] in tops and not placeholder and not (ROOT / cited).exists():
                missing.append(f"{number}: {m.group(1)}")
        for m in re.finditer(r"[\w./-]*\b[\w-]+\.md\b", line):
            name = Path(m.group(0)).name
            if name not in names and f'"{name}"' not in suite:
                missing.append(f"{number}: {m.group(0)}")
    assert not missing, f"{path.relative_to(ROOT)} cites what the repository lacks: {missing}"


def answered_problem_kinds() -> set[str]:
    """Every `kind` the API can answer: the literal second argument of each `Problem(...)` in
    api/ (or every literal in it, `"a" if x else "b"`), and the tables problems.py maps from."""
    import ast

    from api.problems import BATCH_ERRORS, HTTP_KINDS, SSH_ERRORS

    kinds = {kind for _, kind, _ in SSH_ERRORS.values()} | set(BATCH_ERRORS)
    kinds |= set(HTTP_KINDS.values())
    for source in (ROOT / "api").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name == "Problem" and len(node.args) > 1:
                for part in ast.walk(node.args[1]):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        kinds.add(part.value)
    return kinds


def test_every_problem_type_the_api_answers_is_listed() -> None:
    page = (ROOT / "docs" / "http-api.md").read_text()
    listing = page.split("where kind is one of:", 1)[1].split("\n- **", 1)[0]
    listed = set(re.findall(r"`([a-z-]+)`", listing))
    answered = answered_problem_kinds()
    assert len(answered) > 40  # the collection itself works
    assert sorted(answered - listed) == []
    assert sorted(listed - answered) == []
