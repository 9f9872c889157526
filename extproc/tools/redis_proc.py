"""A real ``redis-server`` on loopback for tests, benchmarks and ``warmroute up --brains`` (Debian's package).

Nothing is persisted (no RDB, no AOF): a restart is an empty Redis, the case brains must survive. The port
is one the OS picked a moment before (redis-server cannot report a port it chose itself).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from .procs import Proc, StackError, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise StackError("redis-server is not installed (Debian: apt-get install redis-server; make test installs it)")
    return path


class RedisServer:
    """``redis-server`` on 127.0.0.1; ``password``: requirepass (the default user's); ``acl_user``: (name, password)
    of an ACL user limited to ``key_prefix`` keys and the commands brains use."""

    def __init__(self, workdir: Path, name: str = "redis", password: str | None = None,
                 acl_user: tuple[str, str] | None = None, key_prefix: str = "warmroute:", port: int = 0,
                 tls: dict[str, str] | None = None, tls_auth_clients: bool = False):
        self.workdir, self.name = Path(workdir), name
        # tls: {"cert": server certificate, "key": its key, "ca": the CA of clients' certificates}: TLS only, no plain port
        self.tls, self.tls_auth_clients = tls, tls_auth_clients
        self.password, self.acl_user, self.key_prefix = password, acl_user, key_prefix
        self.port = port or free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"], "--tls-key-file",
                 self.tls["key"], "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients",
                 "yes" if self.tls_auth_clients else "no"] if self.tls else ["--port", str(self.port)]
        a = [redis_binary(), *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no", "--loglevel", "notice"]
        if self.password:
            a += ["--requirepass", self.password]
        if self.acl_user:
            user, pw = self.acl_user
            # what a brain needs and nothing more: its own keys, streams, strings and a lock
            a += ["--user", user, "on", f">{pw}", f"~{self.key_prefix}*", "-@all", "+ping", "+hello", "+auth",
                  "+client", "+xadd", "+xread", "+xrange", "+xtrim", "+get", "+set", "+info"]
        return a

    def start(self) -> "RedisServer":
        self.proc = Proc(self.name, self.argv(), self.workdir)
        wait_for(lambda: "Ready to accept connections" in self.proc.log_tail(20000), 20, f"{self.name} to start",
                 self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def restart(self) -> "RedisServer":
        """Again on the same port, empty."""
        if self.proc is not None:
            self.proc.stop()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["RedisServer", "free_port", "redis_binary"]
