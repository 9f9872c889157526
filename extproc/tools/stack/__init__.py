"""Processes a user or a test starts on loopback: ``procs`` (one process handle, the one ``free_port``), ``local``
(Envoy + brain + replicas), ``real_vllm``, ``redis_server``, ``brains`` (several brains over Redis), ``up`` (the
demo stack) and ``top`` (the operator's view of a running brain)."""
