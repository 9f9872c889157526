"""Replicas from Kubernetes: the ready pods an ``InferencePool`` selects, on its ``targetPorts`` (one
replica per pod and port: a data-parallel engine serves each rank on its own port), or the ready
endpoints of a Service's EndpointSlices.

The official client (``kubernetes``) lists; a watch on the pods (or slices) in a thread says when to
list again at once, and a list every ``interval_s`` is the resync that catches whatever a watch missed.
In a pod it uses the service account (``deploy/`` grants get/list/watch on exactly these resources).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from ..config import DiscoveryConfig, ReplicaSpec
from . import DiscoveryError, replica_name, spec

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_WATCH_S = 240  # a watch is re-opened after this (the API server ends them on its own schedule anyway)


def _load(kubeconfig: str | None) -> Any:
    try:
        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
    except Exception as e:  # a missing file, no service account: one line that says which
        raise DiscoveryError(f"kubernetes: cannot load credentials ({type(e).__name__}: {e})"[:300]) from None
    return api


def _pod_ready(pod: dict) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating: it drains, nothing new goes there
    status = pod.get("status", {})
    if not status.get("podIP") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


ROLE_LABEL = "llm-d.ai/role"  # a pod's part in a disaggregated pool, as llm-d labels it: prefill, decode or both


def pod_role(pod: dict) -> str:
    """A pod's role from its label; absent or a value warmroute does not know: both (it serves whole requests)."""
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)
    return role if role in ("prefill", "decode") else "both"


KV_PORT_ANNOTATION = "warmroute.io/kv-events-port"  # a pod's KV events publisher (exact mode, vLLM before 0.32)
KV_REPLAY_ANNOTATION = "warmroute.io/kv-events-replay-port"  # and its replay socket


def pod_kv_ports(pod: dict) -> tuple[int | None, int | None]:
    """A pod's KV events ports from its annotations; one that is no port number is not believed (None)."""
    notes = (pod.get("metadata") or {}).get("annotations") or {}

    def port(key: str) -> int | None:
        v = notes.get(key)
        return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() and 0 < int(v) < 65536 - 128 else None

    pub = port(KV_PORT_ANNOTATION)
    return (pub, port(KV_REPLAY_ANNOTATION)) if pub is not None else (None, None)


def pool_replicas(d: DiscoveryConfig, pool: dict, pods: list[dict]) -> list[ReplicaSpec]:
    """The replicas of an InferencePool (v1) given its pods: every ready pod x every target port, each with its
    role (``llm-d.ai/role``)."""
    ports = [p["number"] for p in pool.get("spec", {}).get("targetPorts") or []]
    if not ports:
        raise DiscoveryError(f"kubernetes: InferencePool {d.inference_pool} has no spec.targetPorts")
    out = []
    for pod in pods:
        if _pod_ready(pod):
            ip, name = pod["status"]["podIP"], pod["metadata"]["name"]
            for port in ports:
                out.append(spec(d, name if len(ports) == 1 else f"{name}-{port}"[:63], ip, port, pod_role(pod),
                                pod_kv_ports(pod)))
    return out


def slice_replicas(d: DiscoveryConfig, slices: list[dict]) -> list[ReplicaSpec]:
    """The replicas of a Service's EndpointSlices: ready endpoints x the slice's ports (TCP)."""
    out = {}
    for sl in slices:
        ports = [p.get("port") for p in sl.get("ports") or [] if p.get("port") and p.get("protocol", "TCP") == "TCP"]
        for e in sl.get("endpoints") or []:
            if (e.get("conditions") or {}).get("ready") is False or (e.get("conditions") or {}).get("terminating"):
                continue
            ref = (e.get("targetRef") or {}).get("name")
            for ip in e.get("addresses") or []:
                for port in ports:
                    name = (f"{ref}-{port}" if len(ports) > 1 else ref)[:63] if ref else replica_name("ep", ip, port)
                    out[name] = spec(d, name, ip, port)
    return list(out.values())


def own_namespace() -> str:
    """The namespace of the pod the brain runs in (its service account says), else "default"."""
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


class KubernetesSource:
    def __init__(self, d: DiscoveryConfig):
        if d.namespace is None:
            d = dataclasses.replace(d, namespace=own_namespace())
        self.d = d
        self.changed = asyncio.Event()
        self._api = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._selector: str | None = None

    def _client(self) -> Any:
        if self._api is None:
            self._api = _load(self.d.kubeconfig)
        return self._api

    def _list(self) -> tuple[list[ReplicaSpec], str]:
        api, d = self._client(), self.d
        try:
            if d.inference_pool:
                pool = client.CustomObjectsApi(api).get_namespaced_custom_object(
                    POOL_GROUP, POOL_VERSION, d.namespace, POOL_PLURAL, d.inference_pool)
                labels = (pool.get("spec", {}).get("selector") or {}).get("matchLabels") or {}
                if not labels:
                    raise DiscoveryError(f"kubernetes: InferencePool {d.inference_pool} has no "
                                         f"spec.selector.matchLabels")
                selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                pods = api.sanitize_for_serialization(
                    client.CoreV1Api(api).list_namespaced_pod(d.namespace, label_selector=selector).items)
                return pool_replicas(d, pool, pods), selector
            selector = f"kubernetes.io/service-name={d.service}"
            slices = api.sanitize_for_serialization(
                client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(d.namespace, label_selector=selector).items)
            return slice_replicas(d, slices), selector
        except ApiException as e:
            raise DiscoveryError(f"kubernetes: {e.status} {e.reason} from the API server") from None

    async def lookup(self) -> list[ReplicaSpec]:
        found, selector = await asyncio.to_thread(self._list)
        if selector != self._selector or self._watcher is None or not self._watcher.is_alive():
            self._start_watch(selector)
        return found

    def _start_watch(self, selector: str) -> None:
        self._stop.set()
        self._stop = stop = threading.Event()
        self._selector = selector
        loop = asyncio.get_running_loop()
        self._watcher = threading.Thread(target=self._watch, args=(selector, stop, loop), daemon=True,
                                         name="warmroute-kubernetes-watch")
        self._watcher.start()

    def _watch(self, selector: str, stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
        """Any event on the watched pods (or slices) asks for a list now; errors end the thread, and the next
        lookup starts another."""
        api = self._client()
        lister = (client.CoreV1Api(api).list_namespaced_pod if self.d.inference_pool
                  else client.DiscoveryV1Api(api).list_namespaced_endpoint_slice)
        w = watch.Watch()
        try:
            while not stop.is_set():
                for _event in w.stream(lister, self.d.namespace, label_selector=selector, timeout_seconds=_WATCH_S,
                                       _request_timeout=_WATCH_S + 10):
                    if stop.is_set():
                        break
                    loop.call_soon_threadsafe(self.changed.set)
        except Exception:  # noqa: BLE001 - the periodic list goes on; the next lookup restarts the watch
            pass
        finally:
            w.stop()

    async def close(self) -> None:
        self._stop.set()
