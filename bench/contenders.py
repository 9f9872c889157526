"""Who a bench measures, as data: a new contender is an entry here, not code.

- the peers as their users deploy them: Envoy's own load balancers (``ENVOY_POLICIES``: the cluster's lb_policy and
  its ring hash's hash_balance_factor, None: unbounded)
  and the routers from PyPI (``ROUTERS``: binary and policy), started by ``harness.start_peer``;
- warmroute's variants (``WARMROUTE``): config overlays over the shipped default, which ``warmroute`` is as it
  ships (flow control on), started by ``harness.start``.
"""

from __future__ import annotations

ENVOY_POLICIES: dict[str, tuple[str, int | None]] = {
    "envoy_round_robin": ("ROUND_ROBIN", None), "envoy_least_request": ("LEAST_REQUEST", None),
    "envoy_ring_hash": ("RING_HASH", None), "envoy_ring_hash_bounded_150": ("RING_HASH", 150)}
ROUTERS = {
    "vllm_router_cache_aware": ("vllm-router", "cache_aware"),
    "vllm_router_consistent_hash": ("vllm-router", "consistent_hash"),
    "vllm_router_power_of_two": ("vllm-router", "power_of_two"),
    "sglang_router_cache_aware": ("sglang-router", "cache_aware"),
}
PEERS = [*ENVOY_POLICIES, *ROUTERS]

# warmroute's variants: each a config overlay on the shipped default (scaled to the bench's pace by
# harness.scaled_warmroute_config). "warmroute" is the default as shipped; the seed's pipeline; the default as the
# endpoint picker of Envoy in a Gateway API Inference Extension gateway's shape (`envoy-config --mode
# endpoint-picker`), with buffered bodies (the rendered default) and full duplex, as Inference Extension gateways
# send them
WARMROUTE: dict[str, dict] = {
    "warmroute": {},
    "warmroute_seed": {"routing": {"policy": "seed"}},
    "warmroute_endpoint_picker": {"brain": {"protocol": "endpoint-picker"}},
    "warmroute_endpoint_picker_duplex": {"brain": {"protocol": "endpoint-picker"},
                                         "envoy": {"picker_body_mode": "full-duplex"}},
    # data-parallel replicas (--data-parallel): the engine left to the replica's front end
    "warmroute_dp_unsteered": {"warm": {"steer_data_parallel": False}},
    # flow control (on by default) with the class and tenant the bench's clients set themselves (a trusted
    # network); and warmroute without flow control, the baseline of its scenarios
    "warmroute_flow": {"flow_control": {"enabled": True, "trust_downstream_priority_header": True},
                       "envoy": {"trust_downstream_tenant_header": True}},
    "warmroute_no_flow": {"flow_control": {"enabled": False}},
    # on engines that publish KV events (exact mode as shipped): the same brain counting by estimate, not reading them
    "warmroute_estimate": {"exact_cache": {"enabled": False}},
    # the cost model without its decode term (warm.decode_weight 0): time to first token alone, whatever the answer's
    # streaming speed where it runs (issue 49: on a mixed-speed fleet, the TTFT tail against the answers' end)
    "warmroute_ttft_only": {"warm": {"decode_weight": 0.0}},
}
CONTENDERS = [*ENVOY_POLICIES, *WARMROUTE, *ROUTERS]

# which contenders each bench run measures unless told otherwise (--contenders), in the order its tables show them
RUNS: dict[str, list[str]] = {
    "live.flow": ["warmroute_flow", "warmroute_no_flow", "envoy_ring_hash_bounded_150", "envoy_least_request",
                  "sglang_router_cache_aware"],
    "fleet": ["warmroute", "envoy_ring_hash_bounded_150", "envoy_least_request"],
    # the simulator's models of the peers (tools/sim), beside the live ones
    "fleet.simulated": ["warmroute", "envoy_ring_hash_bounded_150", "envoy_least_request", "sglang_cache_aware",
                        "llmd_epp_2025", "llmd_token_aware", "llmd_epp_lora", "dynamo_kv"],
    "real": ["warmroute", "warmroute_estimate", "envoy_ring_hash_bounded_150", "envoy_least_request",
             "sglang_router_cache_aware", "vllm_router_cache_aware"],
    "real.burst": ["warmroute_flow", "warmroute_no_flow", "envoy_ring_hash_bounded_150"],
    "agree": ["warmroute", "warmroute_seed", "envoy_ring_hash_bounded_150", "envoy_ring_hash", "envoy_least_request",
              "sglang_router_cache_aware"],
}


def overlaid(base: dict, contender: str) -> dict:
    """``base`` (a config document) with warmroute variant ``contender``'s overlay, section by section."""
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in WARMROUTE[contender].items():
        config.setdefault(section, {}).update(values)
    return config
