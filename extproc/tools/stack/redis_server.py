"""A real ``redis-server`` on loopback for tests, benchmarks and ``warmroute up --brains`` (Debian's package).

Nothing is persisted (no RDB, no AOF): a restart is an empty Redis, the case brains must survive. The port
is one the OS picked a moment before (redis-server cannot report a port it chose itself).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from extproc.tools.stack.procs import Proc, StackError, free_port, wait_for

# the commands a brain's ACL user needs (docs/brains.md lists the same). No CLIENT subcommand: with one, whoever has
# the password could CLIENT PAUSE every brain's sharing or kill their connections; redis-py's CLIENT SETINFO at
# connect is refused and ignored (Redis 7.0 has no SETINFO to grant alone)
BRAIN_COMMANDS = ("ping", "hello", "auth", "xadd", "xread", "xrange", "xrevrange", "xtrim", "del", "get",
                  "set", "info")



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
        # tls: {"cert": server certificate, "key": its key, "ca": the CA of clients' certificates}: TLS only, no plain
        # port
        self.tls, self.tls_auth_clients = tls, tls_auth_clients
        self.password, self.acl_user, self.key_prefix = password, acl_user, key_prefix
        self.port = port or free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def conf(self) -> str:
        """redis.conf: the secrets go in this file (mode 0600), never in argv, which every local user can read."""
        lines = ["bind 127.0.0.1", "protected-mode yes", 'save ""', "appendonly no", f"dir {self.workdir.resolve()}",
                 "loglevel notice"]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.tls['cert']}",
                      f"tls-key-file {self.tls['key']}", f"tls-ca-cert-file {self.tls['ca']}",
                      f"tls-auth-clients {'yes' if self.tls_auth_clients else 'no'}"]
        else:
            lines.append(f"port {self.port}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.acl_user:
            user, pw = self.acl_user
            # what a brain needs and nothing more: its own keys, streams, strings and a lock (DEL: a stream that
            # cannot advance is started again; XREVRANGE: a brain checks it is not ahead of the stream)
            lines.append(f"user {user} on >{pw} ~{self.key_prefix}* -@all " + " ".join(f"+{c}" for c in BRAIN_COMMANDS))
            if not self.password:
                lines.append("user default off")  # nobody without the ACL user's password gets in
        return "\n".join(lines) + "\n"

    def argv(self) -> list[str]:
        path = self.workdir / f"{self.name}.conf"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.conf())
        return [redis_binary(), str(path)]

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
