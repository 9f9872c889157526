"""The measurements a scenario file names (``runner:``); each is also ``python -m bench.runs.NAME``."""
