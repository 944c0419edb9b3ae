"""A PostgreSQL server of a test's own, which the test may stop and start at will.

The shared server on 5432 serves other test runs and must never be stopped,
so an outage is staged on a private cluster: ``initdb`` into a fresh
directory, ``pg_ctl`` on a free loopback port. PostgreSQL refuses to run as
root, so under root (as in CI) the cluster belongs to the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ..servers import free_port, wait_until

DATABASE = "faults"


def find_bin_dir() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``, or None if this machine has none."""
    candidates = [os.environ.get("PG_BIN", "")]
    found = shutil.which("initdb")
    if found:
        candidates.append(str(Path(found).parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").is_file():
            return Path(candidate)
    return None


@dataclass
class PrivatePostgres:
    """One throwaway cluster: its data directory, port and database URL."""

    bin_dir: Path
    root: Path
    port: int = field(default_factory=free_port)
    user: str | None = None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the test database (over TCP, trust auth)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if self.user is not None:
            kwargs.update(user=self.user, group=pwd.getpwnam(self.user).pw_gid, extra_groups=[])
        # initdb takes UTF8 and the C locale whatever the developer's locale
        # (C alone would mean SQL_ASCII, whose text psycopg hands back as bytes); no PG* variable
        # may point pg_ctl at another cluster.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        return subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
            **kwargs,
        )

    def init(self) -> None:
        """Create the cluster and its database (the caller migrates it)."""
        self._run(
            "initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        self.start()
        engine = create_engine(self.url.replace(f"/{DATABASE}", "/postgres"))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'CREATE DATABASE "{DATABASE}"'))
        engine.dispose()

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=on "
            "-c max_connections=60"
        )
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options,
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``immediate`` is a crash: no checkpoint, clients cut off).

        pg_ctl killed by a signal (it once died of SIGSEGV in a clean-clone
        run, the server's stop half done) is run again while the server runs.
        """
        for tries_left in (2, 1, 0):
            try:
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")
                return
            except subprocess.CalledProcessError as exc:
                if exc.returncode >= 0 or not tries_left:
                    raise
                if not self.running():
                    return

    def running(self) -> bool:
        try:
            self._run("pg_ctl", "-D", str(self.data_dir), "status", timeout=10)
        except subprocess.CalledProcessError:
            return False
        return True

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def destroy(self) -> None:
        if self.data_dir.exists() and self.running():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def private_postgres(bin_dir: Path) -> PrivatePostgres:
    """Make (but do not start) a cluster in a new directory the server's user can reach."""
    # pytest's tmp_path is private to root (0700), which the postgres user
    # cannot enter; so the cluster gets a directory of its own.
    root = Path(tempfile.mkdtemp(prefix="wr-faults-pg-"))
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    return PrivatePostgres(bin_dir=bin_dir, root=root, user=user)


@dataclass
class BlockedDatabase:
    """The fallback on a machine without ``initdb``: a throwaway database on the shared server.

    "Stopping" it refuses new connections and terminates the open ones; the
    server itself, which others use, keeps running.
    """

    admin_url: str
    name: str = field(default_factory=lambda: f"wr_faults_{os.getpid()}_{time.time_ns() % 10**6}")

    @property
    def url(self) -> str:
        return make_url(self.admin_url).set(database=self.name).render_as_string(False)

    def _admin(self, *statements: str) -> None:
        engine = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            for statement in statements:
                conn.execute(text(statement))
        engine.dispose()

    def init(self) -> None:
        self._admin(f'CREATE DATABASE "{self.name}"')

    def stop(self, mode: str = "fast") -> None:
        self._admin(
            f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false',
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{self.name}' AND pid <> pg_backend_pid()",
        )

    def start(self) -> None:
        self._admin(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true')

    def log(self) -> str:
        return ""

    def destroy(self) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def wait_ready(url: str, timeout: float = 30) -> bool:
    """Wait until a connection to ``url`` runs a query."""
    engine = create_engine(url)

    def ready() -> bool:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    try:
        return wait_until(ready, timeout=timeout, interval=0.1)
    finally:
        engine.dispose()
