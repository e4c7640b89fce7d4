"""The process model: `serve` runs the app (api/app.py) under uvicorn in this process, or, with
`settings.workers` > 1, under a supervisor that starts that many worker processes, hands each
connection on its port to the least busy of them (api/handoff.py) and starts again any that
dies (`_supervise`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from api import tasks, tracing
from api.app import create_app
from api.config import Config
from api.handoff import Counted, Dispatcher, HandedServer, Loads
from api.local import resolve_config
from api.policy import Policy
from api.server import EdgeLimits, connection_limit, guarded_protocol
from api.settings import Settings

log = logging.getLogger("sshapi")

# The exit status of a process a background task took down (EX_SOFTWARE): its supervisor,
# systemd or orchestrator starts it again.
TASK_DIED = 70
# Seconds between checks of the workers; a worker that died is started again after this.
SUPERVISE_INTERVAL = 0.5


def _configure_logging(settings: Settings) -> None:
    level = logging.getLevelNamesMapping().get(settings.log_level.upper(), logging.INFO)
    if tracing.enabled():
        # Each line written in a traced context ends with its trace id (api/tracing.py).
        tracing.install_log_ids()
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s%(trace)s")
    else:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # asyncssh logs every channel at INFO: far too much for a server running hundreds a second.
    logging.getLogger("asyncssh").setLevel(max(level, logging.WARNING))


def _uvicorn_options(settings: Settings, config: Config) -> dict[str, Any]:
    """What every server process runs uvicorn with: the keep-alive timeout clients rely on, and
    the edge bounds of api/server.py (header size, header and body deadlines, connections in
    all and per address)."""
    policy = Policy(config)
    ssh = sum(h.limits.max_connections * len(policy.targets(n)) for n, h in config.hosts.items())
    limits = EdgeLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        body_min_rate=settings.body_min_rate,
        max_connections=connection_limit(settings.max_connections, ssh),
        max_per_address=settings.max_connections_per_address,
        trusted_proxies=settings.trusted_proxy_networks,
    )
    return {
        "log_level": settings.log_level,
        "ws": "none",
        "timeout_keep_alive": settings.keepalive_timeout,
        "http": guarded_protocol(limits),
        # The same list decides whose X-Forwarded-For is believed (the client address in logs).
        "forwarded_allow_ips": settings.trusted_proxies,
    }


def serve(settings: Settings, config: Config | None = None) -> None:
    """Run the API in this process until it is stopped: logging at `settings.log_level`, the
    app from `create_app(settings, config=config)`, uvicorn on `settings.host:settings.port`.
    With `settings.workers` > 1, that many worker processes serve the port (`_supervise`).
    A background task that takes the process down (api/services.py) stops the server as
    Ctrl-C does (running jobs get their grace) and the process exits with TASK_DIED."""
    _configure_logging(settings)
    config = config or resolve_config(settings)
    if (warning := per_process_limits(settings)) is not None:
        log.warning("%s", warning)
    if settings.workers > 1:
        _supervise(settings, config)
        return
    died = _stop_when_a_task_dies()
    api = create_app(settings, config=config)
    _freeze_startup_heap()
    uvicorn.run(api, host=settings.host, port=settings.port, **_uvicorn_options(settings, config))
    if died:
        raise SystemExit(TASK_DIED)


def _stop_when_a_task_dies() -> list[BaseException]:
    """Make a fatal task death (api/tasks.py) stop this process's server gracefully: uvicorn's
    own Ctrl-C path (SIGINT), whose KeyboardInterrupt at the end `uvicorn.run` absorbs (and
    `_worker` too). The returned list gets the failure, for the exit status."""
    died: list[BaseException] = []

    def stop(exc: BaseException) -> None:
        died.append(exc)
        os.kill(os.getpid(), signal.SIGINT)

    tasks.on_fatal(stop)
    return died


def per_process_limits(settings: Settings) -> str | None:
    """The start's warning when per-identity limits are counted by each process on its own:
    several workers (or replicas) without Redis. Each process has its own LocalQuota (api/
    quota.py), so an identity whose requests land on N processes gets up to N times each limit.
    Said at the start, with the factor, rather than found out from a user's bill."""
    processes = settings.workers * settings.replicas
    if processes == 1 or settings.redis_url:
        return None
    return (
        f"per-identity limits are counted by each of the {processes} API processes on its own "
        f"({settings.workers} worker(s) x {settings.replicas} replica(s), no SSHAPI_REDIS_URL): "
        f"an identity may get up to {processes} times each per-identity limit (the policy's "
        "rate, burst, max_concurrent and max_transfers; max_followers); set SSHAPI_REDIS_URL "
        f"to share them, or divide them by {processes} in the configuration"
    )


def _freeze_startup_heap() -> None:
    """Put every object alive before serving (the imported libraries, the app) out of the
    garbage collector's reach. Each full collection walked them all with the event loop
    stopped, about once a second at a few hundred jobs/s, and those pauses were the p99 of such
    rates. They live as long as the process anyway; whatever is allocated from here on is
    collected as before (the thresholds stay Python's: raising them let garbage holding SSH read
    buffers pile up). Figures: docs/benchmarks.md, "Figures behind the code"."""
    gc.collect()
    gc.freeze()


def _exit_with_parent(parent: int) -> None:
    """A worker whose supervisor died (SIGKILL leaves no chance to stop it) shuts down
    gracefully instead of serving on as an orphan nobody supervises."""
    while os.getppid() == parent:
        time.sleep(SUPERVISE_INTERVAL)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker(
    settings: Settings,
    config: Config,
    index: int,
    pair: socket.socket,
    loads: Loads,
    supervisor: int,
) -> None:
    """One worker process: its own app, pool and store writer, serving the connections the
    supervisor hands it over `pair`, its requests in flight counted in `loads`. `supervisor`
    is the parent's pid, passed in: read here, after a start of a second or two, the parent
    could already be gone (and the orphan would watch init)."""
    _configure_logging(settings)
    threading.Thread(target=_exit_with_parent, args=(supervisor,), daemon=True).start()
    settings = settings.model_copy(update={"replica": f"{settings.replica}-w{index}"})
    died = _stop_when_a_task_dies()
    app = Counted(create_app(settings, config=config), loads, index)
    server = HandedServer(
        uvicorn.Config(app, **_uvicorn_options(settings, config)), pair, loads, index
    )
    _freeze_startup_heap()
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if died:
        raise SystemExit(TASK_DIED)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _supervise(settings: Settings, config: Config) -> None:
    """Bind the port once, start `settings.workers` processes, hand each connection to the
    least busy (`Dispatcher`), and start again any that dies, under the same index. uvicorn's own
    `workers=` does the same but names no worker: here worker i is always replica
    `<replica>-w<i>`, so a restarted worker marks its own unfinished jobs `lost` (and never a
    sibling's, which a shared name would). Ctrl-C or SIGTERM stops them all."""
    bind = uvicorn.Config(None, host=settings.host, port=settings.port)  # type: ignore[arg-type]
    sock = bind.bind_socket()
    ctx = multiprocessing.get_context("spawn")
    loads = Loads(settings.workers)
    dispatcher = Dispatcher(sock, loads, bind.backlog)

    def start(index: int) -> multiprocessing.process.BaseProcess:
        pair = dispatcher.pair(index)
        proc = ctx.Process(
            target=_worker,
            args=(settings, config, index, pair, loads, os.getpid()),
            name=f"sshapi-worker-{index}",
        )
        proc.start()
        pair.close()  # the worker has its own: a dead worker's pair then fails at once
        return proc

    # SIGTERM (systemd, `kill`) stops the workers through the `finally` below, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    workers = {i: start(i) for i in range(settings.workers)}
    dispatcher.start()
    log.info("%d workers on %s:%d", settings.workers, settings.host, settings.port)
    try:
        while True:
            time.sleep(SUPERVISE_INTERVAL)
            for index, proc in list(workers.items()):
                if not proc.is_alive():
                    log.warning("worker %d exited with %s: starting it again", index, proc.exitcode)
                    workers[index] = start(index)
    finally:
        dispatcher.stop()
        for proc in workers.values():
            if proc.is_alive():
                proc.terminate()  # uvicorn's graceful shutdown: running jobs get the grace
        for proc in workers.values():
            proc.join(settings.shutdown_grace + 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        sock.close()
