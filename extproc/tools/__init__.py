"""What a user runs beside the product, grouped by who it is for (the product never imports from here).

- ``engine/``: the one engine model (prefill, decode, KV cache, eviction) and the engines' ``/metrics`` dialects,
  shared by the mock and the simulator;
- ``workload/``: the agent workload, its HTTP replay, the one counting rule (``measure``) and the open loop;
- ``mock/``: ``warmroute mock-vllm``, a vLLM replica on the engine model;
- ``sim/``: ``warmroute sim``, the fleet simulated in virtual time;
- ``stack/``: processes (the one ``free_port``), the local stack, a real vLLM, Redis, ``warmroute up`` and ``top``;
- ``demo_core``: ``warmroute demo-core``, the core routing in a terminal.

What only the repository runs (benchmarks, chaos, soak, probes, fixture capture) is ``bench/`` beside the package,
outside the wheel.
"""
