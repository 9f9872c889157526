"""A new config file, applied to a running router without dropping in-flight requests.

Added replicas join through the health machine (EJECTED, no cooldown); removed ones are
forgotten (their reservations still release, pins to them rebind on next use); thresholds and
TTLs change at once. Ports cannot change under a running server: the old ``brain`` section stays, and so do
``shared_state`` (the Redis connection and the brain's name) and ``flow_control``.
"""

from __future__ import annotations

import dataclasses

from ..config import AppConfig, ConfigError
from ..contract import brain_headers
from ..core import Router


def _headers(cfg: AppConfig) -> list[str]:
    return brain_headers(cfg.router.profile.session_headers, cfg.router.profile.tenant_reads())


def apply_config(router: Router, old: AppConfig, new: AppConfig, now: float) -> tuple[AppConfig, dict]:
    """Apply ``new`` to ``router``; returns the config now in force and what changed.

    Raises ``ConfigError`` (nothing applied) for a config that would leave no replica, unless it says
    ``allow_no_replicas: true``."""
    if old.replicas and not new.replicas and not new.allow_no_replicas:
        raise ConfigError(f"replicas: {new.source} lists no replica; the reload is refused and the old config kept "
                          "(set allow_no_replicas: true to empty the fleet on purpose)")
    # the Redis connection and this brain's name are the running process's, like its ports
    shared_changed = new.shared_state != old.shared_state
    # flow control's queue and Envoy's extended timer (rendered at start) are the running process's too
    flow_changed = new.flow_control != old.flow_control
    new = dataclasses.replace(new, brain=old.brain, shared_state=old.shared_state, flow_control=old.flow_control)
    old_names = {r.name for r in old.replicas}
    new_names = {r.name for r in new.replicas}
    for r in new.replicas:
        if r.name not in old_names:
            router.add_replica(r.name, now)
    for name in old_names - new_names:
        router.remove_replica(name)
    router.update_config(new.router)
    info = {"added": sorted(new_names - old_names), "removed": sorted(old_names - new_names),
            "replicas": len(new_names)}
    if _headers(new) != _headers(old):
        # Envoy sends only the headers its (static) ext_proc config names: until it runs a bootstrap rendered
        # from this file, a new session or tenant header never reaches the brain.
        info["envoy_config_stale"] = "profile.session_headers/tenant_header changed: re-render and restart Envoy"
    changed = [name for name, c in (("shared_state", shared_changed), ("flow_control", flow_changed)) if c]
    if changed:
        info["restart_needed"] = (f"{' and '.join(changed)} changed: it takes effect when the brain (and Envoy, "
                                  "re-rendered) restarts; the old one stays")
    return new, info
