"""The architecture's rules, checked on the source tree (issue 13).

* `import sshpool` loads nothing of the dev rig (`sshpool.devhost`).
* The sshpool package reads no SSHAPI_* variable: the API's environment is the API's.
* api/ imports sshpool by its public names only (`from sshpool import ...`), never a submodule:
  the one exception is the dev rig, which the `sshapi dev` command imports inside the command.
* No module of sshpool/, api/ or loadtests/ imports a private name (`_x`, or a module `_m`) of
  another package.
* The file routes call the file service only: api/routes/files.py never touches an SFTP session
  (no `.fs` attribute anywhere in it).
* The client package (`api/client/`) imports nothing of `api` outside `api.client`: the server
  may use the client, never the reverse (issue 27), so `import api.client` loads no server.
* The HTTP schemas load nothing of the Slurm client or the jobs package.
* The feature packages (`api/jobs`, `files`, `live`, `store`, `client`, `admin`) are imported by
  the rest of api/ through their faces only (the names of their `__init__`'s `__all__`).
* The routes touch no store, pool or policy: they call a service (`JobService`, `FileService`,
  `AdminService`).
* No module of api/ or sshpool/ is over 600 lines, but the few named with their reasons.
* No import circles in sshpool/, api/ or loadtests/: no two modules import each other, directly
  or round about (`_import_graph` says what counts).
* A module's `if __name__ == "__main__":` block is its last statement: what follows it is not yet
  defined when `python -m` runs the module (loadtests.certificates named a function defined
  below it, and `python -m loadtests.certificates` failed with NameError while every test,
  which imports the module, passed).
* The test files that tests/conftest.py hands to the xdist workers first (LONGEST_FILES) exist: a
  renamed one would drop to the end of the run unnoticed.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sshpool", "api", "loadtests")


def test_import_sshpool_loads_no_dev_rig() -> None:
    code = "import json, sys, sshpool; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = json.loads(done.stdout)
    assert "sshpool.pool" in loaded
    assert [m for m in loaded if m == "sshpool.devhost" or m.startswith("sshpool.devhost.")] == []


def test_sshpool_reads_no_sshapi_variable() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "sshpool").rglob("*"))
        if path.is_file() and path.suffix in (".py", ".tuned", ".toml", ".cfg", ".txt")
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "SSHAPI_" in line
    ]
    assert hits == []


# The sshpool submodules api/ may import, and the one place each: the dev rig for `sshapi dev`,
# inside the command so that no other command loads it.
API_SSHPOOL_SUBMODULES = {"sshpool.devhost": "api/cli.py"}


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str, list[str]]]:
    """Every absolute import in `tree`: the statement, the module, and the names taken from it
    (none for `import m`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node, node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []


def _sshpool_submodule_imports(path: Path) -> list[str]:
    """`from sshpool.x import ...` and `import sshpool.x` in one api/ module, but for the
    allowed submodule imported inside a function of its one module."""
    where = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), str(path))
    nested = {
        id(node)
        for scope in ast.walk(tree)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(scope)
    }
    found: list[str] = []
    for node, module, _ in _imports(tree):
        if not module.startswith("sshpool."):
            continue
        home = API_SSHPOOL_SUBMODULES.get(".".join(module.split(".")[:2]))
        if home == where and id(node) in nested:
            continue
        found.append(f"{where}:{node.lineno}: {module}")
    return found


def test_api_imports_sshpool_by_its_public_names_only() -> None:
    """What the pool hands to the API (SFTP sessions, files, attributes, errors, results) is
    exported by `sshpool`: an import from a submodule means the package's face lacks a name."""
    found = [
        hit
        for path in sorted((ROOT / "api").rglob("*.py"))
        for hit in _sshpool_submodule_imports(path)
    ]
    assert found == []


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports(path: Path) -> list[str]:
    """`from pkg.mod import _x`, `from pkg._mod import x`, `import pkg._mod` where pkg is not
    the importing module's own top-level package."""
    own = path.relative_to(ROOT).parts[0]
    found: list[str] = []
    for node, module, names in _imports(ast.parse(path.read_text(), str(path))):
        if module.split(".")[0] == own:
            continue
        private = [part for part in [*module.split("."), *names] if _is_private(part)]
        if private:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} {private}")
    return found


def test_no_module_imports_a_private_name_of_another_package() -> None:
    found = [
        hit
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _private_imports(path)
    ]
    assert found == []


def _server_imports(path: Path) -> list[str]:
    """The imports of `api` modules outside `api.client` in one file (relative imports stay in
    the package: the client has no parent to reach)."""
    found: list[str] = []
    for node, imported, names in _imports(ast.parse(path.read_text(), str(path))):
        modules = [f"api.{name}" for name in names] if imported == "api" and names else [imported]
        for module in modules:
            if module.split(".")[0] == "api" and module.split(".")[:2] != ["api", "client"]:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}")
    return found


def test_the_client_package_imports_nothing_of_the_server() -> None:
    found = [
        hit
        for path in sorted((ROOT / "api" / "client").rglob("*.py"))
        for hit in _server_imports(path)
    ]
    assert found == []
    code = "import json, sys, api.client; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = json.loads(done.stdout)
    assert [m for m in loaded if m.startswith("api.") and not m.startswith("api.client")] == []


def test_file_routes_never_touch_the_sftp_session() -> None:
    path = ROOT / "api" / "routes" / "files.py"
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "fs"
    ]
    assert found == []


def test_http_schemas_load_nothing_of_the_slurm_client() -> None:
    """api/schemas.py takes the batch request's shape from api/batchspec.py: loading the HTTP
    schemas loads neither the Slurm client nor the jobs package (issue 27)."""
    code = "import json, sys, api.schemas; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = json.loads(done.stdout)
    assert "api.schemas" in loaded
    assert [
        m for m in loaded if m in ("api.scheduler", "api.jobs") or m.startswith("api.jobs.")
    ] == []


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every `module.name` a file imports (`from m import n` as `m.n`), with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


# The feature packages of api/ and their faces: what the rest of api/ may import from each.
# `api.client.cli` is the client's second face, the researcher's commands that `sshapi`
# registers (kept apart so that `import api.client` loads no CLI framework).
FEATURES = ("jobs", "files", "live", "store", "client", "admin")
EXTRA_FACES = {"api.client.cli"}


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_packages_are_imported_through_their_faces(feature: str) -> None:
    """Outside api/<feature>/, api/ imports the feature's `__init__` (the names in its
    `__all__`) only, never one of its modules: each feature has one face."""
    face = importlib.import_module(f"api.{feature}")
    inside = ROOT / "api" / feature
    prefix = f"api.{feature}."
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "api").rglob("*.py"))
        if inside not in path.parents
        for line, name in _imported_modules(path)
        if name.startswith(prefix)
        and name.split(".")[2] not in face.__all__
        and ".".join(name.split(".")[:3]) not in EXTRA_FACES
    ]
    assert found == []


# The most lines a module of api/ or sshpool/ may have (a generated module included): past it, a
# module holds more than one thing and is split by what it does.
MAX_MODULE_LINES = 600
# The modules allowed past it, and why each is one thing however long.
LONG_MODULES = {
    "sshpool/backends/ssh2.py": "one backend: libssh2 driven non-blocking (exec, SFTP) is one "
    "state machine over one session; its ctypes extras are apart (ssh2_extras.py)",
    "sshpool/backends/paramiko.py": "one backend: paramiko's blocking calls run in threads of "
    "its own, with what paramiko lacks (TCP_NODELAY, dead peers, exit signals), exec and SFTP",
    "sshpool/devhost/host.py": "one rig: LocalHost makes, starts and stops a real sshd on "
    "loopback with its keys, CA, account and profiles, what every test and benchmark logs into",
}


@pytest.mark.parametrize("package", ["api", "sshpool"])
def test_no_module_is_over_the_size_limit(package: str) -> None:
    """Every module of api/ and sshpool/ keeps within MAX_MODULE_LINES lines, but the named
    LONG_MODULES."""
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    over = {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES and p not in LONG_MODULES}
    assert over == {}
    assert [p for p in LONG_MODULES if p.startswith(f"{package}/") and p not in sizes] == []


# Where api/ may start a task itself, and who awaits it (api/services.py's tables): everywhere
# else a task is the supervisor's (`Supervisor.spawn`) or a service's (`TaskSet.spawn`).
TASK_STARTERS = {
    "api/tasks.py": "the owners themselves",
    "api/jobs/runner.py": "a job's command and marker, awaited by the job's runner task",
    "api/files/transfers.py": "a transfer's next read or write, awaited by the request",
    "api/routes/files.py": "a checksum and its disconnect watch, awaited by the request",
    "api/handles.py": "a live stream's check of its job handle, awaited by the stream",
}


def test_every_task_of_the_api_has_an_owner() -> None:
    """No bare `create_task`/`ensure_future` outside the owners listed above (issue 27: a task
    nobody owns dies silently)."""
    found = []
    for path in sorted((ROOT / "api").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("api/client/") or rel in TASK_STARTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("create_task", "ensure_future"):
                found.append(f"{rel}:{node.lineno}: {node.attr}")
    assert found == []


def test_a_script_block_is_the_last_statement_of_its_module() -> None:
    late = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            body = ast.parse(path.read_text()).body
            late += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for node in body[:-1]
                if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
            ]
    assert late == [], late


def _module(path: Path) -> str:
    """The dotted name of a source file of the tree (a package by its `__init__`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each module of sshpool/, api/ and loadtests/ -> the modules of the tree it imports.

    What counts: every `import` statement, wherever it stands: at module level, inside a
    function (a lazy import still needs the other module when it runs) and under
    `if TYPE_CHECKING:` (a type names the other module's design: the pool <-> cluster circle
    was such an import). `from p import n` imports the module `p.n` when there is one, else `p`
    (its `__init__`); relative imports are resolved. The parent packages Python runs first do
    not count: every module would import its package's face."""
    modules = {
        _module(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    if f"{module}.{alias.name}" in modules:
                        found.add(f"{module}.{alias.name}")
                    elif module in modules:
                        found.add(module)
        graph[name] = found - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round about (the strongly
    connected components of more than one module: Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    """No two modules of sshpool/, api/ or loadtests/ import each other, directly or round
    about (what counts as an import: `_import_graph`). A circle means neither can be read, or
    changed, without the other: the shared part goes to a module of its own, or the lower one
    states what it needs of the higher as a Protocol (`sshpool.budget.Member`,
    `sshpool.cluster.NodePools`)."""
    graph = _import_graph()
    assert "sshpool.pool" in graph["sshpool"]  # the graph is built: a module's imports are seen
    assert _circles(graph) == []


# What the routes reach only through a service (api/jobs' JobService, api/files' FileService,
# api/admin's AdminService): the objects a service holds, read off `Services` as attributes.
BEHIND_SERVICES = ("store", "pool", "policy")
# The one route that reads one itself, and why.
ROUTE_READS = {("api/routes/ops.py", "store"): "/readyz pings the store: what the probe reports"}


def test_routes_touch_no_store_pool_or_policy() -> None:
    """No route module touches the store, the pool or the policy (`svc.store`, `svc.pool`,
    `svc.policy`, or any `.store`, `.pool`, `.policy`): a route calls its service, so that
    what it may do is what the service offers, and the service's checks are never skipped.
    The admin, node-drain and host routes touched them at 14 places."""
    found = []
    for path in sorted((ROOT / "api" / "routes").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in BEHIND_SERVICES
                and (rel, node.attr) not in ROUTE_READS
            ):
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert found == []


def test_the_longest_test_files_named_for_xdist_exist() -> None:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    [listing] = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["LONGEST_FILES"]
    ]
    assert isinstance(listing, ast.Dict)
    named = [ast.literal_eval(key) for key in listing.keys if key is not None]
    assert len(named) > 10
    assert [f for f in named if not (ROOT / f).is_file()] == []
