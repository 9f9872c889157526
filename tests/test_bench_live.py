"""`make bench` runs the workload faster than real time: warmroute's time constants must shrink with it."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core.config import HealthConfig, PinConfig, WarmConfig
from extproc.tools.bench_live import scaled_warmroute_config


@pytest.mark.parametrize("section,cls", [("warm", WarmConfig), ("health", HealthConfig), ("pins", PinConfig)])
def test_every_time_constant_is_divided_by_the_speedup(section, cls):
    # a constant left at its real-time value sees 20x too few events in its window (e.g. a busy-fleet threshold
    # of 1 s reads as 20 s of workload time, so the fleet never looks busy)
    scaled = scaled_warmroute_config(20.0)[section]
    seconds = [f for f in dataclasses.fields(cls) if f.name.endswith("_s") and not f.name.endswith("_per_s")]
    assert seconds
    for f in seconds:
        assert scaled.get(f.name) == pytest.approx(f.default / 20.0), f.name


def test_the_access_log_flush_that_releases_reservations_shrinks_too():
    assert scaled_warmroute_config(5.0)["envoy"]["access_log_flush_s"] == pytest.approx(0.002)
    assert scaled_warmroute_config(20.0)["envoy"]["access_log_flush_s"] == pytest.approx(0.001)  # Envoy's floor: 1 ms
