"""warmroute: the LLM-aware routing brain behind Envoy (ext_proc)."""

__version__ = "0.1.0"
