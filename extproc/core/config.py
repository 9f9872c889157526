"""Routing parameters. Every default is a number from SPEC.md (section noted).

The core never reads files: the shell turns the YAML file into these
dataclasses (see ``extproc.config``) and hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HealthConfig:
    scrape_interval_s: float = 3.0  # A1
    good_scrapes_to_probe: int = 2  # A2: EJECTED -> PROBING
    probing_clean_window_s: float = 15.0  # A2: PROBING -> LIVE
    cooldown_base_s: float = 30.0  # A2: 30 s * 2^(n-1)
    cooldown_max_s: float = 300.0  # A2: capped at 300 s
    streak_reset_live_s: float = 600.0  # A2: streak resets after 600 s of continuous LIVE
    stale_scrape_intervals: float = 3.0  # B: a scrape older than 3 intervals counts as failed
    upstream_failures_to_eject: int = 3  # B: N consecutive upstream failures eject a LIVE replica

    def cooldown_s(self, streak: int) -> float:
        """Cooldown for the ``streak``-th ejection in a row (A2): 30, 60, 120, 240, 300, 300..."""
        if streak <= 0:
            return 0.0
        # min() before the power keeps a long streak from building a huge float
        return min(self.cooldown_max_s, self.cooldown_base_s * 2 ** min(streak - 1, 62))


@dataclass(frozen=True, slots=True)
class PinConfig:
    session_ttl_s: float = 3600.0  # A3: session pins live 60 min idle
    prefix_ttl_s: float = 300.0  # A3: prefix pins live 5 min idle
    session_slack: int = 1  # A3
    prefix_slack: int = 0  # A3
    session_spills_to_rebind: int = 3  # A3: 3 spills in a row -> the session pin moves
    prefix_spills_to_delete: int = 2  # B: the second consecutive prefix spill deletes it
    force_rebind_gap: float = 3.0  # A3: effective_running(pin) - min_r >= 3 -> move at once
    # Ablation switches for the simulator; production leaves them on. With spill_enabled off a
    # pin holds whenever its replica is LIVE, whatever the load: the seed's removed "never rebind".
    ttl_enabled: bool = True
    spill_enabled: bool = True


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    session_headers: tuple[str, ...] = ("x-session-id", "x-kilo-session", "x-conversation-id")  # A3
    session_body_fields: tuple[str, ...] = ("conversation_id", "thread_id")  # A3
    tenant_header: str | None = "x-warmroute-tenant"  # A3: the seed's project_id, trusted header
    prefix_chars: int = 4096  # A3: MD5 of the first 4096 characters of the system prompt
    chars_per_token: float = 4.0  # B: estimate = characters / 4
    max_body_bytes: int = 64 * 1024 * 1024  # B: larger bodies are routed by headers only


@dataclass(frozen=True, slots=True)
class RouterConfig:
    health: HealthConfig = field(default_factory=HealthConfig)
    pins: PinConfig = field(default_factory=PinConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    token_weight_unit: int = 1000  # B: weight = max(1, prompt_tokens_estimate / 1000)
    probing_max_in_flight: int = 1  # B: a PROBING replica holds at most 1 request while a LIVE one exists
    reservation_timeout_s: float = 3600.0  # B: safety release of reservations whose end was never seen
    # Ablation switches for the simulator (issue 3).
    wlc_enabled: bool = True
    no_wait_enabled: bool = True
    seed: int = 0  # the fallback's random choice is seeded so runs replay exactly
