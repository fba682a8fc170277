"""The daemon: one event loop owning the tier, a task per connection, the writer, signals.

SIGTERM or SIGINT: stop accepting, flush the write-behind queue within the shutdown deadline,
close, exit 0. A second signal exits at once.

Descriptors: the soft open-file limit is raised to the hard one at start, and connections are
capped below it (max_connections; one more is told `too_many_connections` and closed). Should
the process still run out (EMFILE, ENFILE: other files, a low hard limit), accepting pauses
with a growing back-off, logged once, and resumes as soon as a connection is accepted again.
"""

from __future__ import annotations

import errno
import grp
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import anyio
from anyio.abc import SocketListener, SocketStream, TaskGroup
from kvd_protocol.connection import Connection, Role
from kvd_protocol.errors import ErrorCode
from kvd_protocol.limits import DEFAULT_LIMITS, Limits

from kvd import __version__
from kvd.config import Config
from kvd.logs import get_logger
from kvd.remote.local_tier import LocalTier
from kvd.remote.remote import Remote
from kvd.serve import event_loop
from kvd.serve.fd_limit import connections_for, raise_open_file_limit
from kvd.serve.frame_budget import FrameBudget
from kvd.serve.handlers import op_table
from kvd.serve.listener import bind_socket, inherited_socket
from kvd.serve.metrics_http import metrics_listener, serve_metrics
from kvd.serve.op_row import Context
from kvd.serve.peer import Peer, tenant_of
from kvd.serve.peercred import peer_credentials
from kvd.serve.sd_notify import Notifier, watchdog_interval
from kvd.serve.session import Session, raw_socket
from kvd.serve.status import status_report
from kvd.store.tier import Tier
from kvd.store.watcher import reconcile_periodically, watch_entries

log = get_logger("kvd.serve.server")

RESTART_SECONDS = 0.5  # the first pause before a failed background task runs again
RESTART_MAX_SECONDS = 30.0
# accept() errors that mean "no descriptor or memory for one more now": wait, then retry.
OUT_OF_DESCRIPTORS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept() errors that mean the listening socket itself is unusable: nothing to retry.
LISTENER_GONE: Final = frozenset({errno.EBADF, errno.ENOTSOCK, errno.EINVAL})
ACCEPT_BACKOFF: Final = (0.01, 1.0)  # seconds: first pause, longest pause


class Server:
    """The daemon's process: the tier, the listening socket and every task of the loop.

    run() opens the tier, then serves: a Session per accepted connection (after a check of
    the peer's credentials), the writer, the watcher and the periodic reconcile and snapshot,
    the service manager's watchdog; and on SIGTERM or SIGINT flushes and saves the snapshot.
    """

    def __init__(self, config: Config, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.tier = Tier(config, limits)
        self.remote = _remote(config, self.tier)
        self.ops = op_table(self.remote)
        self.peers: dict[int, Peer] = {}
        self.max_connections = config.max_connections
        self._sessions = itertools.count(1)
        self._allowed_gid = _group_id(config.socket_group)
        self.frames = FrameBudget(config.frame_buffer_bytes, config.frame_timeout)

    def status(self) -> dict[str, Any]:
        return status_report(self.tier, self.peers.values(), self.remote)

    async def handle(self, stream: SocketStream) -> None:
        """One connection, start to end; nothing it does may take the server down."""
        session_id = next(self._sessions)
        try:
            async with stream:
                if len(self.peers) >= self.max_connections:
                    log.warning("connection_refused", connections=len(self.peers))
                    refusal = Connection(Role.SERVER).send_final_error(
                        ErrorCode.TOO_MANY_CONNECTIONS,
                        f"kvd serves {self.max_connections} connections already; try later",
                    )
                    await stream.send(refusal)
                    return
                credentials = peer_credentials(raw_socket(stream))
                if not self._allowed(credentials.uid, credentials.gid):
                    log.warning("peer_refused", uid=credentials.uid, pid=credentials.pid)
                    refusal = Connection(Role.SERVER).send_final_error(
                        ErrorCode.PERMISSION_DENIED, f"uid {credentials.uid} may not use this kvd"
                    )
                    await stream.send(refusal)
                    return
                admin = credentials.uid in (os.getuid(), 0)
                # A peer of another uid (a socket_group member) names only identities of its
                # own user, unless the deployment trusts every member with the daemon's.
                shared = admin or self.config.share_between_users
                tenant = "" if shared else tenant_of(credentials.uid)
                peer = Peer(session_id, credentials, admin=admin, tenant=tenant)
                self.peers[session_id] = peer
                try:
                    context = Context(self.tier, self.remote, peer, self.status)
                    await Session(context, self.ops, stream, self.frames).run()
                finally:
                    del self.peers[session_id]
        except Exception:
            log.exception("session_crashed", session=session_id)

    def _allowed(self, uid: int, gid: int) -> bool:
        return uid in (os.getuid(), 0) or (
            self._allowed_gid is not None and gid == self._allowed_gid
        )

    async def run(self) -> None:
        open_files = raise_open_file_limit()
        if not self.max_connections:
            self.max_connections = connections_for(open_files)
        log.info("limits", open_files=open_files, max_connections=self.max_connections)
        port = self.config.metrics_port
        metrics = await metrics_listener(port) if port else None  # a taken port: not started
        await self.tier.life.open()
        sock = inherited_socket()
        owns_socket = sock is None
        if sock is None:
            sock = bind_socket(self.config.socket, self._allowed_gid)
        listener = await SocketListener.from_socket(sock)
        notifier = Notifier.from_environ()
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._serve, listener, tasks)
                tasks.start_soon(self._watchdog, notifier)
                self._start_background(tasks)
                if metrics is not None:  # kept running: an accept() failure must not stop kvd
                    scrapes = partial(serve_metrics, metrics, self.status)
                    tasks.start_soon(keep_running, "metrics", scrapes)
                log.info(
                    "serving",
                    socket=str(self.config.socket),
                    version=__version__,
                    loop=event_loop.loop_name(),
                )
                notifier.ready(f"serving {len(self.tier.view)} entries")
                await self._wait_for_signal(listener, notifier)
                tasks.cancel_scope.cancel()
        finally:
            if owns_socket:
                self.config.socket.unlink(missing_ok=True)
            self.tier.life.close()
            if self.remote is not None:
                self.remote.close()
            notifier.close()
            if metrics is not None:
                await metrics.aclose()
        log.info("stopped")

    def _start_background(self, tasks: TaskGroup) -> None:
        """The tasks that run for the daemon's life, each kept running through failures."""
        tier, config = self.tier, self.config
        tasks.start_soon(_settle, tier)  # the watcher and the reconcile wait for it
        tasks.start_soon(keep_running, "writer", tier.life.run_writer)
        watcher = partial(watch_entries, tier.life)
        restarted_watcher = partial(watch_entries, tier.life, reconcile_first=True)
        tasks.start_soon(keep_running, "watcher", watcher, restarted_watcher)
        reconciler = partial(reconcile_periodically, tier.life, config.reconcile_interval)
        tasks.start_soon(keep_running, "reconcile", reconciler)
        snapshotter = partial(tier.life.snapshot_periodically, config.snapshot_interval)
        tasks.start_soon(keep_running, "snapshot", snapshotter)
        tasks.start_soon(keep_running, "put_expiry", tier.life.expire_puts_periodically)
        tasks.start_soon(keep_running, "lease_expiry", tier.life.expire_leases_periodically)
        if self.remote is not None:
            tasks.start_soon(keep_running, "remote", self.remote.run)

    async def _serve(self, listener: SocketListener, tasks: TaskGroup) -> None:
        pause = 0.0
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return  # closed by the shutdown
            except (anyio.BrokenResourceError, OSError) as exc:
                # anyio's Unix listener wraps every accept() error as BrokenResourceError.
                cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc
                code = getattr(cause, "errno", None)
                if code in LISTENER_GONE:
                    log.error("listener_failed", error=str(cause))
                    raise
                if code not in OUT_OF_DESCRIPTORS:
                    log.warning("accept_failed", error=str(cause))  # the peer gave up: next
                    continue
                if not pause:
                    log.warning("accept_paused", error=str(cause), connections=len(self.peers))
                first, longest = ACCEPT_BACKOFF
                pause = min(longest, pause * 2 or first)
                await anyio.sleep(pause)
                continue
            if pause:
                log.info("accept_resumed", connections=len(self.peers))
                pause = 0.0
            tasks.start_soon(self.handle, stream)

    async def _watchdog(self, notifier: Notifier) -> None:
        interval = watchdog_interval()
        if interval is None:
            return
        while True:  # a task of the event loop: a hung loop stops the pings
            notifier.watchdog()
            await anyio.sleep(interval)

    async def _wait_for_signal(self, listener: SocketListener, notifier: Notifier) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("stopping", signal=signal.Signals(signum).name)
                notifier.stopping()
                await listener.aclose()
                async with anyio.create_task_group() as shutdown:
                    shutdown.start_soon(self._exit_on_second_signal, signals)
                    durable, pending = await self.tier.admin.flush(self.config.shutdown_deadline)
                    log.info("flushed", durable=durable, pending=pending)
                    try:
                        await self.tier.life.save_snapshot()
                    except OSError as exc:  # a full disk, say: the next start scans more
                        log.warning("snapshot_failed", error=str(exc))
                    shutdown.cancel_scope.cancel()
                return

    @staticmethod
    async def _exit_on_second_signal(signals: Any) -> None:
        async for signum in signals:
            log.warning("exiting_now", signal=signal.Signals(signum).name)
            os._exit(1)


def _remote(config: Config, tier: Tier) -> Remote | None:
    """The remote tier, when `remote` is set, handed the parts of the local tier it uses."""
    if not config.remote:
        return None
    local = LocalTier(
        limits=tier.limits,
        view=tier.view,
        reads=tier.reads,
        puts=tier.puts,
        settled=tier.life.wait_settled,
        flush=tier.admin.flush,
        on_stored=tier.notices.on_stored,
        on_hit=tier.notices.on_hit,
    )
    return Remote(config, local)


async def _settle(tier: Tier) -> None:
    """Start-up's listing (LifeCycle.settle), once: a failure is logged, never the daemon's end,
    and what waits for it goes on (files stay checked by mtime as well)."""
    try:
        await tier.life.settle()
    except Exception:
        log.exception("task_failed", task="settle")


async def keep_running(
    name: str,
    task: Callable[[], Awaitable[None]],
    restarted: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run a background task that is meant to run forever; if it fails or ends, log it and
    start it again (as restarted, if given) after a pause that grows while it keeps failing:
    a broken disk or a bug in one task never takes the daemon down."""
    pause = RESTART_SECONDS
    while True:
        began = time.monotonic()
        try:
            await task()
            log.warning("task_ended", task=name)
        except Exception:
            log.exception("task_failed", task=name)
        if time.monotonic() - began > RESTART_MAX_SECONDS:
            pause = RESTART_SECONDS  # it ran a good while: a new failure, not the same one
        await anyio.sleep(pause)
        pause = min(pause * 2, RESTART_MAX_SECONDS)
        log.info("task_restarted", task=name)
        task = restarted or task


def _group_id(name: str | None) -> int | None:
    if name is None:
        return None
    return grp.getgrnam(name).gr_gid


def serve(config: Config) -> None:
    anyio.run(Server(config).run, backend_options=event_loop.backend_options())
