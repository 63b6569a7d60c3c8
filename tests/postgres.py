"""A real PostgreSQL server for the test suite: Debian's `postgresql` binaries, a fresh cluster
in a temporary directory, on a free loopback port, stopped and removed at the end. The cluster
Debian's package may have created (and started on 5432) is never touched."""

from __future__ import annotations

import atexit
import getpass
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

import psycopg
from psycopg import sql

from esk.broker.ports import free_port

PG_ROOT = Path("/usr/lib/postgresql")
# PostgreSQL refuses to run as root, so a root test run hands the cluster to this user.
TEST_OS_USER = "esk-test"
_INSTALL_HINT = "run `make tools-postgres` (as root: apt-get install --no-install-recommends postgresql)"


class PostgresUnavailable(RuntimeError):
    """The server binaries are missing, or the server would not start."""


def find_bin_dir(root: Path = PG_ROOT) -> Path:
    """The newest /usr/lib/postgresql/<version>/bin holding both initdb and pg_ctl."""
    candidates: list[tuple[tuple[int, ...], Path]] = []
    for version_dir in root.glob("*") if root.is_dir() else []:
        bin_dir = version_dir / "bin"
        if not all(os.access(bin_dir / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            continue
        # Versions are "15", "16" or the old "9.6": compare them as numbers, not strings.
        key = tuple(int(part) for part in re.findall(r"\d+", version_dir.name))
        candidates.append((key, bin_dir))
    if not candidates:
        raise PostgresUnavailable(f"PostgreSQL server not found (no {root}/<version>/bin/initdb and pg_ctl): {_INSTALL_HINT}")
    return max(candidates)[1]


def _ensure_os_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    # A concurrent run may create the user between the lookup and useradd: only the lookup after it counts.
    subprocess.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ],
        check=False,
        capture_output=True,
    )
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise PostgresUnavailable(
            f"could not create the OS user {name!r} that runs the test PostgreSQL server (useradd failed)"
        ) from None


class PostgresServer:
    """One throwaway cluster. `start()` runs initdb and pg_ctl; `dsn` reaches its database;
    `stop()` shuts it down and deletes every file of it."""

    def __init__(self, database: str = "esk", os_user: str = TEST_OS_USER) -> None:
        self.bin_dir = find_bin_dir()
        self.database = database
        self._as_root = os.geteuid() == 0
        # Not root: the cluster runs as whoever runs the tests, who is then also its superuser.
        self.user = os_user if self._as_root else getpass.getuser()
        self.host = "127.0.0.1"
        self.port = 0
        self.base_dir: Path | None = None
        self._running = False

    @property
    def version(self) -> str:
        return self.bin_dir.parent.name

    @property
    def dsn(self) -> str:
        return self.dsn_for(self.database)

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    @property
    def log_file(self) -> Path:
        assert self.base_dir is not None, "server not started"
        return self.base_dir / "postgres.log"

    def start(self, attempts: int = 3) -> None:
        try:
            self._start(attempts)
        except BaseException:
            self.stop()
            raise

    def _start(self, attempts: int) -> None:
        # Our own directory under /tmp, not pytest's tmp_path: that one sits under a 0700 root-owned
        # directory the unprivileged server user could not enter.
        self.base_dir = Path(tempfile.mkdtemp(prefix="esk-pg-"))
        if self._as_root:
            account = _ensure_os_user(self.user)
            os.chown(self.base_dir, account.pw_uid, account.pw_gid)
        # Registered before anything can start: a session that dies without its fixture teardown
        # would otherwise leave a daemonized postmaster behind.
        atexit.register(self.stop)
        self._run(
            "initdb",
            f"--pgdata={self._data_dir}",
            f"--username={self.user}",
            # Trust over the loopback only (listen_addresses below): nobody else can reach it.
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",
            # Tests throw the cluster away: durability of its bootstrap files buys nothing.
            "--no-sync",
        )
        self._socket_dir.mkdir()
        if self._as_root:
            shutil.chown(self._socket_dir, user=self.user, group=self.user)
        # From here on stop() tries pg_ctl stop: a start that timed out may have left a postmaster.
        self._running = True
        for attempt in range(1, attempts + 1):
            # The free port may be taken again between choosing and binding it: try another.
            self.port = free_port()
            try:
                self._pg_ctl_start()
                break
            except PostgresUnavailable:
                if attempt == attempts or "could not bind" not in self._log_tail():
                    raise
        with self.connect("postgres") as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))

    def _pg_ctl_start(self) -> None:
        self._run(
            "pg_ctl",
            "start",
            "--wait",
            "--timeout=60",
            f"--pgdata={self._data_dir}",
            f"--log={self.log_file}",
            f"--options=-p {self.port} -k {self._socket_dir} -c listen_addresses={self.host} -c fsync=off",
        )

    def down(self) -> None:
        """The server shut down (its sessions ended), its data kept: an outage, which `up`
        ends on the same port."""
        self._run("pg_ctl", "stop", "--wait", "--mode=fast", f"--pgdata={self._data_dir}")

    def up(self) -> None:
        self._pg_ctl_start()

    def stop(self) -> None:
        if self._running:
            self._running = False
            # Fast: roll back open sessions rather than wait for a leaked test connection to close.
            self._run("pg_ctl", "stop", "--wait", "--mode=fast", f"--pgdata={self._data_dir}", check=False)
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None
        atexit.unregister(self.stop)

    def connect(self, database: str | None = None) -> psycopg.Connection[tuple[object, ...]]:
        """An autocommit connection as the superuser: for DDL such as CREATE DATABASE."""
        return psycopg.connect(self.dsn_for(database or self.database), autocommit=True)

    def create_database(self, name: str) -> str:
        with self.connect("postgres") as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        with self.connect("postgres") as conn:
            # FORCE: a connection a failed test leaked must not keep its database (and the port) busy.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def _data_dir(self) -> Path:
        assert self.base_dir is not None, "server not started"
        return self.base_dir / "data"

    @property
    def _socket_dir(self) -> Path:
        assert self.base_dir is not None, "server not started"
        return self.base_dir / "sock"

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        command = [str(self.bin_dir / tool), *args]
        if self._as_root:
            command = ["runuser", "-u", self.user, "--", *command]
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        # The server user may not be allowed into the caller's working directory.
        result = subprocess.run(command, cwd=self.base_dir, env=env, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            detail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
            log = self._log_tail()
            raise PostgresUnavailable(
                f"{tool} failed ({result.returncode}): {detail[0]}" + (f"; server log: {log}" if log else "")
            )

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_file.read_text(errors="replace").strip().splitlines()[-lines:])
        except (OSError, AssertionError):
            return ""
