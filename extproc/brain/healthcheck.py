"""``warmroute health``: ask a brain's gRPC health service, as a container's health check or a probe does.

Exit 0 when the service answers SERVING, 1 otherwise (NOT_SERVING, unknown, unreachable, timeout), with
one line that says which."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "readiness", timeout_s: float = 2.0, ca: str | None = None,
          cert: str | None = None, key: str | None = None, name: str | None = None) -> tuple[bool, str]:
    if ca or cert:
        def read(p: str | None) -> bytes | None:
            if not p:
                return None
            with open(p, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as e:
        return False, f"{target} {service}: {e.code().name} {e.details() or ''}".strip()
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, f"{target} {service}: {status}"
