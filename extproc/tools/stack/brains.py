"""Several brains over one fleet, sharing state through a real Redis (issue 33): the stack of tests,
benchmarks and ``warmroute up --brains K``.

``pairs``: K Envoy + brain pairs (clients spread over the Envoys), the default shape. The replicas and Redis are
started once; each pair is a ``Stack`` of its own (its config, socket, ports, logs) over the same replicas.
``picker``: K brains as endpoint pickers behind one Envoy in the Inference Extension's shape, which spreads the
requests over them (``envoy.brain_endpoints``; a gateway reaches a picker Deployment's replicas so).
``processes``: K brains in the default (ext_proc) shape behind one Envoy: several processes of one host, one core
each; an access-log entry that reaches another process than the one that decided is handed back through Redis.
``shared=False`` gives the same topology with sharing off (each brain alone: the comparison).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from extproc.envoy_config import bootstrap
from extproc.tools.stack.local import Stack
from extproc.tools.stack.redis_server import RedisServer

SHAPES = ("pairs", "picker", "processes")


class BrainsStack:
    def __init__(self, n_replicas: int = 4, brains: int = 2, config: dict | None = None,
                 mock_args: list[str] | None = None, shared: bool = True, workdir: str | Path | None = None,
                 shared_state: dict | None = None, redis: "RedisServer | dict | None" = None,
                 listen_ports: list[int] | None = None, shape: str = "pairs", failover: bool = True):
        if shape not in SHAPES:
            raise ValueError(f"shape: one of {', '.join(SHAPES)}, got {shape!r}")
        self.n, self.k, self.shape = n_replicas, brains, shape
        # pairs sharing state: each Envoy asks the other brains while its own is down (envoy.brain_failover)
        self.failover = failover and shared and shape == "pairs" and brains > 1
        self.config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (config or {}).items()}
        self.mock_args = mock_args or []
        self.shared = shared
        self.shared_state = {"flush_ms": 5.0, "heartbeat_s": 0.5, "peer_timeout_s": 3.0, "snapshot_every_s": 5.0,
                             **(shared_state or {})}
        # a RedisServer of the caller's (started and stopped by it), or RedisServer's arguments for one of ours
        self.own_redis = not isinstance(redis, RedisServer)
        self.redis_kw = redis if self.own_redis and redis else {}
        self.redis: RedisServer | None = None if self.own_redis else redis
        self.listen_ports = listen_ports or [0] * brains
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="warmroute-brains-")
            workdir = self._tmp.name
        self.dir = Path(workdir)
        self.stacks: list[Stack] = []

    def _secrets(self) -> None:
        """Redis as an operator should run it: an ACL user whose password is in a 0600 file (the default user off),
        and the fleet's signing secret in another; the brains read both from their files."""
        from extproc.brain.files import secret_in

        self.shared_state.setdefault("secret_file", str((self.dir / "shared.secret").resolve()))
        secret_in(self.shared_state["secret_file"], "shared_state.secret_file")
        if self.own_redis and not {"password", "acl_user"} & set(self.redis_kw):
            pw_file = str((self.dir / "redis.password").resolve())
            password = secret_in(pw_file, "shared_state.password_file").decode()
            self.redis_kw = {**self.redis_kw, "acl_user": ("warmroute", password)}
            self.shared_state.setdefault("username", "warmroute")
            self.shared_state.setdefault("password_file", pw_file)

    def _config(self, i: int) -> dict:
        cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.config.items()}
        if self.shared:
            cfg["shared_state"] = {"redis_url": self.redis.url, "brain_id": f"brain-{i}", **self.shared_state}
        if self.shape == "picker":
            cfg["brain"] = {**cfg.get("brain", {}), "protocol": "endpoint-picker"}
        if self.failover:
            cfg["envoy"] = {**cfg.get("envoy", {}), "brain_failover": [
                f"unix:{(self.dir / f'pair-{j}').resolve() / 'brain.sock'}" for j in range(self.k) if j != i]}
        return cfg

    def start(self) -> "BrainsStack":
        try:
            if self.shared:
                self._secrets()
            if self.shared and self.own_redis:
                self.redis = RedisServer(self.dir, **self.redis_kw).start()
            first = Stack(self.n, config=self._config(0), mock_args=self.mock_args, workdir=self.dir / "pair-0",
                          listen_port=self.listen_ports[0])
            self.stacks.append(first)
            # every brain first: an Envoy that names the others' brains waits for them all to be healthy
            first.start(envoy=self.shape == "pairs" and not self.failover)
            for i in range(1, self.k):
                self.start_pair(i)
            if self.failover:
                for s in self.stacks:
                    s.start_envoy()
            if self.shape != "pairs":
                cfg = first.live_config()
                others = tuple(f"unix:{Path(s.cfg.brain.grpc_socket).resolve()}" for s in self.stacks[1:])
                first.start_envoy(bootstrap(dataclasses.replace(cfg, envoy=dataclasses.replace(
                    cfg.envoy, brain_endpoints=others))))
        except BaseException:
            self.stop()
            raise
        return self

    def start_pair(self, i: int) -> Stack:
        s = Stack(0, config=self._config(i), workdir=self.dir / f"pair-{i}",
                  listen_port=self.listen_ports[i] if i < len(self.listen_ports) else 0)
        s.replicas = list(self.stacks[0].replicas)
        if i < len(self.stacks):
            self.stacks[i] = s
        else:
            self.stacks.append(s)
        s.start(envoy=self.shape == "pairs" and not self.failover)
        return s

    def restart_brain(self, i: int) -> None:
        """A brain killed and started again on its ports (its Envoy stays): it warms from the others' view."""
        s = self.stacks[i]
        s.brain.kill()
        s.start_brain()

    @property
    def urls(self) -> list[str]:
        """Where clients go: each pair's Envoy, or the one Envoy in front of the pickers."""
        return [s.url for s in self.stacks] if self.shape == "pairs" else [self.stacks[0].url]

    def wait_all_live(self, timeout: float = 60) -> None:
        for s in self.stacks:
            s.wait_all_live(timeout)

    def stop(self) -> None:
        for s in reversed(self.stacks):
            try:
                s.stop()
            except Exception:
                pass
        if self.redis is not None and self.own_redis:
            self.redis.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "BrainsStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["BrainsStack", "SHAPES"]
