"""Small pieces every part of Envoy's config is written with: durations, addresses, circuit-breaker thresholds."""

from __future__ import annotations

from ..config import is_ip  # noqa: F401 (read from here by the other parts)

BIG = 1_000_000  # circuit-breaker ceilings: LLM requests are long, Envoy's 1024 defaults are not for them


def dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def thresholds(max_requests: int = BIG) -> dict:
    return {
        "thresholds": [
            {"priority": p, "max_connections": BIG, "max_pending_requests": BIG, "max_requests": max_requests,
             "max_retries": BIG} for p in ("DEFAULT", "HIGH")
        ]
    }
