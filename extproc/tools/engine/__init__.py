"""The engine as the mock and the simulator both run it: ``model`` (one engine's scheduler, prefill, decode and
prefix cache in virtual time) and ``metrics`` (what each engine dialect's ``/metrics`` says about it)."""
