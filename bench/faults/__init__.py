"""Faults and hostile clients against a live stack: chaos, the soak, the hardening probes."""
