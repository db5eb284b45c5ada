"""Private PostgreSQL and RabbitMQ servers that the chaos suite owns, stops and restarts.

The shared services on 5432 and 5672 serve other test runs at the same time, so a fault
that stops a server must hit a server of our own: each class here starts one on free
loopback ports in a temporary directory, stops and restarts it on command, and ends it
by its pid. The pytest fixtures at the bottom start each once per session.

Both servers require a password, so the URLs the relays get carry a real secret that the
suite then looks for in every log line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.services import IN_CI, free_port, port_open

#: Every private server lives in a directory named like this, with the owning pid in ``owner``.
DIRECTORY_PREFIX = "outboxer-chaos-"


def missing_tool(reason: str) -> None:
    """Fail (CI) or skip (locally) the calling fixture: the chaos suite cannot run here."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f}s")
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _private_directory(kind: str) -> Path:
    base = Path(tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{kind}-"))
    (base / "owner").write_text(str(os.getpid()))
    return base


# ----- PostgreSQL ------------------------------------------------------------------------------


def _postgres_bin() -> Path | None:
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: p.parts)
    return versions[-1].parent if versions else None


class PrivatePostgres:
    """A PostgreSQL cluster in a temporary directory, on a free port, password required.

    ``stop()`` is ``pg_ctl stop -m immediate``: the postmaster and every backend end at once,
    without a checkpoint, as in a crash; ``start()`` runs crash recovery. The cluster runs
    with ``fsync=off``: an immediate stop is no operating-system crash, so what reached the
    kernel survives it (and what the relay committed with ``synchronous_commit=off`` but had
    not written yet is lost, as in a real crash), while the shared 2-core box is spared the
    flushes.
    """

    user = "postgres"

    def __init__(self) -> None:
        bin_dir = _postgres_bin()
        if bin_dir is None:
            missing_tool("PostgreSQL server binaries (/usr/lib/postgresql/*/bin) are not installed")
        assert bin_dir is not None
        self.bin_dir = bin_dir
        self.as_postgres: list[str] = []
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            if shutil.which("runuser") is None:
                missing_tool("running as root needs runuser to start PostgreSQL as postgres")
            self.as_postgres = ["runuser", "-u", "postgres", "--"]
        self.base = _private_directory("postgres")
        self.data = self.base / "data"
        self.sockets = self.base / "sockets"
        self.sockets.mkdir()
        if self.as_postgres:
            shutil.chown(self.base, "postgres")
            shutil.chown(self.sockets, "postgres")
        self.port = free_port()
        self.password = "pg-" + secrets.token_hex(12)
        self.starts = 0

    def _run(self, *args: str, timeout: float = 120) -> None:
        subprocess.run(
            [*self.as_postgres, *args],
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd=self.base,
        )

    def init(self) -> PrivatePostgres:
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        self.start()
        import psycopg

        with psycopg.connect(
            host=str(self.sockets), port=self.port, user=self.user, dbname="postgres"
        ) as conn:
            conn.execute(f"ALTER ROLE {self.user} PASSWORD '{self.password}'")
        return self

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200 -c shared_buffers=64MB"
        )
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.base / "postgres.log"),
            "-w",
            "-t",
            "90",
            "-o",
            options,
            "start",
        )
        self.starts += 1

    def stop(self, mode: str = "immediate") -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    @property
    def pid(self) -> int | None:
        """The postmaster's pid, or None when it is not running."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _pid_alive(pid) else None

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def close(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(subprocess.SubprocessError):
                self.stop()
        pid = self.pid
        if pid is not None:  # pg_ctl could not stop it: end the postmaster we started
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


# ----- RabbitMQ ----------------------------------------------------------------------------------


def _rabbitmq_scripts() -> tuple[str, str] | None:
    """rabbitmq-server and rabbitmqctl that run as the caller (not Debian's su wrappers)."""
    packaged = Path("/usr/lib/rabbitmq/bin")
    if (packaged / "rabbitmq-server").exists():
        return str(packaged / "rabbitmq-server"), str(packaged / "rabbitmqctl")
    server, ctl = shutil.which("rabbitmq-server"), shutil.which("rabbitmqctl")
    return (server, ctl) if server and ctl else None


class PrivateRabbitMQ:
    """A second RabbitMQ node, ``outboxer-chaos-<pid>@localhost``, on free ports.

    Its own home (so its own Erlang cookie), database, logs and configuration: nothing of
    the shared node's is read or changed; it only registers with the host's epmd, which
    every node on the machine shares. Its user ``chaos`` has a random password.
    ``stop()`` is ``rabbitmqctl stop`` (the node halts; durable queues and persistent
    messages stay on disk), ``start()`` boots it again on the same ports and data.
    """

    user = "chaos"

    def __init__(self) -> None:
        scripts = _rabbitmq_scripts()
        if scripts is None:
            missing_tool("rabbitmq-server is not installed")
        assert scripts is not None
        self.server_script, self.ctl_script = scripts
        self.base = _private_directory("rabbitmq")
        # Unique per node, not only per process: two fixture scopes of one session each
        # start one, and a second node of the same name never comes up.
        self.node = f"outboxer-chaos-{os.getpid()}-{secrets.token_hex(3)}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.password = "mq-" + secrets.token_hex(12)
        self.starts = 0
        for name in ("home", "mnesia", "log"):
            (self.base / name).mkdir()
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's, the shared node's
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
            f"default_user = {self.user}\n"
            f"default_pass = {self.password}\n"
            "default_permissions.configure = .*\n"
            "default_permissions.read = .*\n"
            "default_permissions.write = .*\n"
        )

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.base / "home"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.base / "rabbitmq.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def start(self, timeout: float = 90) -> None:
        subprocess.run(
            [self.server_script, "-detached"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=30,
            cwd=self.base,
        )
        _wait(lambda: port_open(self.port), timeout, f"RabbitMQ node {self.node} did not listen")
        self.starts += 1

    def stop(self, timeout: float = 60) -> None:
        """Halt the node (``rabbitmqctl stop`` waits until it is down)."""
        pid = self.pid
        subprocess.run(
            [self.ctl_script, "-n", self.node, "stop"],
            env=self.env,
            check=False,
            capture_output=True,
            timeout=timeout,
        )
        if pid is not None:
            _wait(lambda: not _pid_alive(pid), timeout, f"RabbitMQ node {self.node} did not stop")

    @property
    def pid(self) -> int | None:
        try:
            pid = int((self.base / "rabbitmq.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        return (
            pid if _pid_alive(pid) and str(self.base) in _cmdline(pid) else None
        )  # -home <base>/home

    def url(self, exchange: str) -> str:
        return f"amqp://{self.user}:{self.password}@127.0.0.1:{self.port}/?exchange={exchange}"

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, RuntimeError):
            self.stop(timeout=30)
        pid = self.pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


# ----- leftovers of a run that was killed --------------------------------------------------------


def reap_orphans() -> None:
    """End the private servers of an earlier run whose pytest died without its teardown.

    Only directories named by this module, whose owner pid is gone, and only processes whose
    command line names that directory or node: never anything another run still uses.
    """
    for owner in Path(tempfile.gettempdir()).glob(f"{DIRECTORY_PREFIX}*/owner"):
        base = owner.parent
        try:
            owner_pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(owner_pid):
            continue
        candidates = [base / "data" / "postmaster.pid", base / "rabbitmq.pid"]
        for pid_file in candidates:
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            command = _cmdline(pid)
            if _pid_alive(pid) and str(base) in command:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


# ----- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PrivatePostgres]:
    """This session's own PostgreSQL cluster (tests may stop and start it)."""
    reap_orphans()
    server = PrivatePostgres()
    try:
        server.init()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def private_rabbitmq() -> Iterator[PrivateRabbitMQ]:
    """This session's own RabbitMQ node (tests may stop and start it)."""
    reap_orphans()
    server = PrivateRabbitMQ()
    try:
        server.start()
        yield server
    finally:
        server.close()
