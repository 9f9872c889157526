"""The mock replica's command line (``warmroute mock-vllm``): its engine, its faults, its APIs, its metrics."""

from __future__ import annotations

import argparse

from extproc.tools.engine.metrics import DIALECTS
from extproc.tools.engine.model import DECODE_HORIZON_S, EngineConfig
from extproc.tools.workload.generate import MOCK_MODEL


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 lets the OS pick; the bound port is printed")
    ap.add_argument("--model", default=MOCK_MODEL)
    ap.add_argument("--name", default="mock", help="reported as system_fingerprint, so a client can see who served it")
    ap.add_argument("--kv-tokens", type=int, default=d.kv_tokens, help="KV cache size in tokens")
    ap.add_argument("--cpu-tier-tokens", type=int, default=0, help="a CPU tier under the KV cache, in tokens (vLLM's "
                    "OffloadingConnector): blocks evicted from the GPU go down, a prompt's run of them past its GPU "
                    "hit "
                    "is restored ~10x faster than computed; exports vllm:kv_offload_load_time (0: none)")
    ap.add_argument("--speed", type=float, default=1.0, help="prefill and decode speed against the default engine "
                    "(0.5: a GPU half as fast); exported cache size and rates follow")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--max-model-len", type=int, default=None, help="the longest request it reads (vLLM's flag; "
                    "default: the KV cache's size); a longer prompt is vLLM's 400")
    ap.add_argument("--default-max-tokens", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=1.0, help="divide every engine step time by this")
    ap.add_argument("--decode-horizon-s", type=float, default=DECODE_HORIZON_S,
                    help="pure-decode steps are run and streamed this much engine time at a time (0: token by token)")
    ap.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 503")
    ap.add_argument("--flap-every", type=float, default=0.0, help="die every this many seconds (0: never)")
    ap.add_argument("--flap-down", type=float, default=5.0, help="and stay down this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-alive-s", type=float, default=5.0, help="close a keep-alive connection idle this long, as "
                    "vLLM's uvicorn does (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)")
    ap.add_argument("--tls-cert", default=None, help="serve HTTPS with this PEM certificate (and --tls-key)")
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                    help="off: vLLM's --no-enable-prefix-caching (every prompt computed whole; cache_config_info says "
                    "so)")
    ap.add_argument("--metrics", choices=(*DIALECTS, "none"), default="vllm",
                    help="whose /metrics to export, as that engine's code defines and moves them: vllm (0.11+), "
                    "vllm-old (0.8-0.10), sglang (none: no /metrics at all, like a foreign OpenAI server)")
    ap.add_argument("--no-metrics", action="store_true", help="no /metrics (vLLM --disable-log-stats; SGLang without "
                    "--enable-metrics)")
    ap.add_argument("--data-parallel", type=int, default=1, help="engines behind one front end (vLLM "
                    "--data-parallel-size): each its own scheduler and KV cache of --kv-tokens, spread by vLLM's rule "
                    "or the X-data-parallel-rank header")
    ap.add_argument("--lora-adapters", default="", help="comma-separated LoRA adapter names it serves (vLLM "
                    "--lora-modules); a request names one as its model")
    ap.add_argument("--max-loras", type=int, default=1, help="adapters on the GPU at once (vLLM --max-loras)")
    ap.add_argument("--lora-load-s", type=float, default=0.5, help="engine seconds a step pays to bring an adapter "
                    "into a GPU slot")
    ap.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                    help="vLLM --runner: generate serves completions, pooling serves /v1/embeddings and /pooling")
    ap.add_argument("--responses-store", action="store_true", help="keep Responses API responses in memory for "
                    "previous_response_id, retrieval and cancel (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
    ap.add_argument("--kv-transfer-tokens-per-s", type=float, default=0.0, help="prefill/decode disaggregation (vLLM "
                    "--kv-transfer-config, kv_role kv_both, NIXL's exchange): KV moves between replicas at this many "
                    "prompt tokens a second; 0: no connector, kv_transfer_params ignored")
    ap.add_argument("--kv-lease-s", type=float, default=30.0, help="a prefill leg's blocks wait this long for a decode "
                    "replica to read them (NixlConnector kv_lease_duration)")
    ap.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail",
                    help="a decode leg whose KV cannot be loaded fails (vLLM's default) or computes the prompt itself")
    ap.add_argument("--disable-fastapi-docs", action="store_true", help="no /openapi.json (vLLM's flag of that name)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (only what /metrics and /server_info say)")
    ap.add_argument("--metrics-all-ranks", action="store_true", help="SGLang --enable-metrics-for-all-schedulers: "
                    "every tensor-parallel rank exports a copy of its scheduler's gauges")
