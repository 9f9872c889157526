"""Kubernetes discovery with the official client against a stand-in API server on loopback.

No Kubernetes API server can run on this machine (no kube-apiserver, no etcd, no container runtime
that starts one); the stand-in serves responses written after the API reference (an InferencePool of
inference.networking.k8s.io/v1, a PodList, EndpointSlices of discovery.k8s.io/v1, a watch stream of
JSON lines), at the paths and with the query parameters the client really sends.
"""

from __future__ import annotations

import dataclasses

import asyncio
import json
import threading

import pytest
from aiohttp import web

from extproc.config import ConfigError, DiscoveryConfig, parse_config
from extproc.discovery import DiscoveryError, follow
from extproc.discovery.kubernetes import KubernetesSource

NS = "llm"
POOL = {
    "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
    "metadata": {"name": "coder", "namespace": NS, "resourceVersion": "10"},
    "spec": {"selector": {"matchLabels": {"app": "vllm-coder"}}, "targetPorts": [{"number": 8000}],
             "endpointPickerRef": {"name": "warmroute", "port": {"number": 9002}, "failureMode": "FailOpen"}},
}


def pod(name: str, ip: str, ready: bool = True, terminating: bool = False) -> dict:
    meta = {"name": name, "namespace": NS, "labels": {"app": "vllm-coder"}, "resourceVersion": "11"}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def endpoint_slice(endpoints: list[tuple[str, str, bool]], port: int = 8000) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "vllm-abcde", "namespace": NS, "labels": {"kubernetes.io/service-name": "vllm"}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": n}}
                          for n, ip, ready in endpoints]}


class FakeApi:
    """The few API paths discovery reads, with what the test says they hold."""

    def __init__(self):
        self.pool = dict(POOL)
        self.pods = [pod("coder-0", "10.0.0.10"), pod("coder-1", "10.0.0.11", ready=False)]
        self.slices = [endpoint_slice([("vllm-0", "10.1.0.5", True), ("vllm-1", "10.1.0.6", False)])]
        self.watchers: list[asyncio.Queue] = []
        self.selectors: list[str] = []
        self.down = False
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get(f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{{name}}",
                           self.get_pool)
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self.list_pods)
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", self.list_slices)
        # handlers still open at shutdown (a watch) are cancelled after 5 s instead of aiohttp's 60
        self.runner = web.AppRunner(app, shutdown_timeout=5.0)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()

    def _gate(self):
        if self.down:
            raise web.HTTPServiceUnavailable(text='{"kind":"Status","status":"Failure","code":503}')

    async def get_pool(self, request):
        self._gate()
        if request.match_info["name"] != self.pool["metadata"]["name"]:
            raise web.HTTPNotFound(text='{"kind":"Status","status":"Failure","reason":"NotFound","code":404}')
        return web.json_response(self.pool)

    async def list_pods(self, request):
        self._gate()
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request)
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "12"},
                                  "items": self.pods})

    async def list_slices(self, request):
        self._gate()
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request)
        return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                  "metadata": {"resourceVersion": "12"}, "items": self.slices})

    async def _watch(self, request):
        q: asyncio.Queue = asyncio.Queue()
        self.watchers.append(q)
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        while (event := await q.get()) is not None:
            await resp.write(json.dumps(event).encode() + b"\n")
        return resp

    def set_pods(self, pods: list[dict]) -> None:
        """Change the pods and tell every watch, as the API server does."""
        def push():
            self.pods = pods
            for q in self.watchers:
                q.put_nowait({"type": "MODIFIED", "object": pods[0] if pods else pod("x", "0.0.0.0")})
        self.loop.call_soon_threadsafe(push)

    def stop(self) -> None:
        async def down():
            for q in self.watchers:
                q.put_nowait(None)
            await self.runner.shutdown()
            await self.runner.cleanup()  # ends the watches' handlers too

        # a deadline, not a pace: on a busy machine (make test runs these at a low priority) the shutdown of open
        # watches took more than 10 s once
        asyncio.run_coroutine_threadsafe(down(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def kubeconfig(self, path) -> str:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "t", "user": {"token": "t"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t", "namespace": NS}}]}))
        return str(path)


@pytest.fixture
def api():
    a = FakeApi()
    yield a
    a.stop()


def test_an_inference_pools_ready_pods_on_its_target_ports(api, tmp_path):
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="coder",
                        kubeconfig=api.kubeconfig(tmp_path / "k"))
    found = asyncio.run(KubernetesSource(d).lookup())
    assert [(r.name, r.url) for r in found] == [("coder-0", "http://10.0.0.10:8000")]  # coder-1 is not Ready
    assert "app=vllm-coder" in api.selectors
    # a data-parallel pod serves each rank on its own port: one replica per pod and port
    api.pool = {**POOL, "spec": {**POOL["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    found = asyncio.run(KubernetesSource(d).lookup())
    assert [r.url for r in found] == ["http://10.0.0.10:8000", "http://10.0.0.10:8001"]


def test_a_pods_llm_d_role_label_is_its_role(api, tmp_path):
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="coder",
                        kubeconfig=api.kubeconfig(tmp_path / "k"))
    prefill, decode, other = pod("p-0", "10.0.0.20"), pod("d-0", "10.0.0.21"), pod("x-0", "10.0.0.22")
    prefill["metadata"]["labels"]["llm-d.ai/role"] = "prefill"
    decode["metadata"]["labels"]["llm-d.ai/role"] = "decode"
    other["metadata"]["labels"]["llm-d.ai/role"] = "encode"
    api.pods = [prefill, decode, other]
    found = asyncio.run(KubernetesSource(d).lookup())
    assert [(r.name, r.role) for r in found] == [("p-0", "prefill"), ("d-0", "decode"), ("x-0", "both")]


def test_a_services_endpoint_slices(api, tmp_path):
    d = DiscoveryConfig(source="kubernetes", namespace=NS, service="vllm", kubeconfig=api.kubeconfig(tmp_path / "k"))
    found = asyncio.run(KubernetesSource(d).lookup())
    assert [(r.name, r.url) for r in found] == [("vllm-0", "http://10.1.0.5:8000")]
    assert "kubernetes.io/service-name=vllm" in api.selectors


def test_a_watch_event_brings_the_change_before_the_resync_and_an_api_outage_keeps_the_last_set(api, tmp_path):
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="coder", interval_s=60.0,
                        kubeconfig=api.kubeconfig(tmp_path / "k"))
    applied, failures = [], []

    async def scenario():
        src = KubernetesSource(d)
        task = asyncio.create_task(follow(src, d.interval_s, applied.append, failures.append))
        await _until(lambda: applied and api.watchers, "the first list and a watch")
        # a pod turns Ready and a new one starts terminating: the watch says so, long before the 60 s resync
        api.set_pods([pod("coder-0", "10.0.0.10", terminating=True), pod("coder-1", "10.0.0.11"),
                      pod("coder-2", "10.0.0.12")])
        await _until(lambda: len(applied) >= 2, "the watched change")
        api.down = True
        src.changed.set()  # ask again now: the API server answers 503
        await _until(lambda: failures, "the failed list")
        task.cancel()
        await src.close()

    asyncio.run(scenario())
    assert [r.name for r in applied[0]] == ["coder-0"]
    assert [r.name for r in applied[1]] == ["coder-1", "coder-2"]  # the terminating pod gets nothing new
    assert len(applied) == 2 and "503" in failures[0]  # the outage applied nothing: the last set stays


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_missing_credentials_and_a_missing_pool_are_one_line_errors(api, tmp_path):
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="coder", kubeconfig=str(tmp_path / "none"))
    with pytest.raises(DiscoveryError, match="cannot load credentials"):
        asyncio.run(KubernetesSource(d).lookup())
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="nope",
                        kubeconfig=api.kubeconfig(tmp_path / "k"))
    with pytest.raises(DiscoveryError, match="404"):
        asyncio.run(KubernetesSource(d).lookup())


def test_discovery_config_errors_name_the_field():
    cases = {
        "discovery.source": {"source": "consul"},
        "discovery.dns_name": {"source": "dns"},
        "discovery.inference_pool": {"source": "kubernetes"},
        r"discovery.dns_servers\[0\]": {"source": "dns", "dns_name": "x", "dns_servers": ["nameserver"]},
        "discovery.engine": {"engine": "tgi"},
    }
    for field, doc in cases.items():
        with pytest.raises(ConfigError, match=f"^{field}:"):
            parse_config({"discovery": doc})


def test_a_source_naming_more_replicas_than_a_fleet_has_is_a_failure_not_a_fleet():
    from extproc.config import ReplicaSpec
    from extproc.discovery import MAX_REPLICAS

    class Flood:
        changed = asyncio.Event()

        def __init__(self):
            self.n = 2

        async def lookup(self):
            return [ReplicaSpec(f"r{i}", f"http://10.0.{i // 250}.{i % 250 + 1}:8000") for i in range(self.n)]

    applied, failures = [], []

    async def scenario():
        src = Flood()
        task = asyncio.create_task(follow(src, 0.01, applied.append, failures.append))
        await _until(lambda: applied, "the first set")
        src.n = MAX_REPLICAS + 1
        await _until(lambda: failures, "the flood refused")
        task.cancel()

    asyncio.run(scenario())
    assert len(applied) == 1 and len(applied[0]) == 2  # the last good set stays
    assert f"more than {MAX_REPLICAS}" in failures[0]


def test_a_pod_names_its_kv_events_ports_by_annotation_else_the_config_s_ports_hold(api, tmp_path):
    """Issue 63: exact mode on engines that do not list their publishers (vLLM before 0.32): a pod's annotations
    name its publisher's and replay socket's ports on its own address; without them the config's ports hold; an
    annotation that is no port is not believed."""
    d = DiscoveryConfig(source="kubernetes", namespace=NS, inference_pool="coder",
                        kubeconfig=api.kubeconfig(tmp_path / "k"),
                        kv_events_port=5557, kv_events_replay_port=5558)
    own, plain, bad = pod("a-0", "10.0.0.30"), pod("b-0", "10.0.0.31"), pod("c-0", "10.0.0.32")
    own["metadata"]["annotations"] = {"warmroute.io/kv-events-port": "6000",
                                      "warmroute.io/kv-events-replay-port": "6001"}
    bad["metadata"]["annotations"] = {"warmroute.io/kv-events-port": "²"}
    api.pods = [own, plain, bad]
    found = {r.name: r.kv_events for r in asyncio.run(KubernetesSource(d).lookup())}
    assert found == {"a-0": (("tcp://10.0.0.30:6000", "tcp://10.0.0.30:6001"),),
                     "b-0": (("tcp://10.0.0.31:5557", "tcp://10.0.0.31:5558"),),
                     "c-0": (("tcp://10.0.0.32:5557", "tcp://10.0.0.32:5558"),)}
    # data-parallel engines publish at the ports after (vLLM offsets them by the rank); no config port: asked
    d2 = dataclasses.replace(d, kv_events_port=None, kv_events_replay_port=None, kv_events_data_parallel_size=2)
    found = {r.name: r.kv_events for r in asyncio.run(KubernetesSource(d2).lookup())}
    assert found == {"a-0": (("tcp://10.0.0.30:6000", "tcp://10.0.0.30:6001"), ("tcp://10.0.0.30:6001", "tcp://10.0.0.30:6002")),
                     "b-0": (), "c-0": ()}
