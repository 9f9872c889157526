"""``warmroute mock-vllm``: a vLLM replica over HTTP on the engine model (``vllm``), with the APIs agents call
(``apis``: chat, Anthropic Messages, stored Responses)."""
