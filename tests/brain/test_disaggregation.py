"""Prefill/decode disaggregation's decision in the core (issue 48): roles, when a prefill leg pays, its books."""

from __future__ import annotations

import dataclasses
import json

import pytest

from extproc.brain.legs import decode_body, prefill_body
from extproc.config import ConfigError, parse_config
from extproc.core import LoadSample, RouterConfig
from extproc.core.apis import Api
from extproc.core.config import DisaggregationConfig
from extproc.core.disaggregation import TransferRate
from extproc.core.names import BodyStatus
from extproc.discovery.kubernetes import pod_role

from ..helpers import chain, envoy_decide, live_router, prof


def pd_router(n: int = 4, prefill: tuple[str, ...] = ("r0",), **pd):
    cfg = RouterConfig(policy="warm", disaggregation=DisaggregationConfig(**pd))
    router, t = live_router(n, cfg)
    router.set_roles({name: "prefill" for name in prefill})
    router.disaggregates = True
    return router, t


def long_prompt(tokens: int = 40_000, session: str = "s1", api: Api = Api.CHAT):
    return dataclasses.replace(prof(session=session, tokens=tokens, blocks=chain("sys", session, tokens)), api=api)


def busy(router, t, names, running: int = 12):
    """Long streams decoding on these replicas (as their scrapes say)."""
    for name in names:
        router.on_load(name, LoadSample(running, 0, 0.3), t)


def test_a_prefill_replica_never_takes_a_whole_request():
    router, t = pd_router(4, prefill=("r0", "r1"))
    chosen = {router.select(prof(session=f"s{i}", tokens=100), t).replica.name for i in range(40)}
    assert chosen <= {"r2", "r3"} and chosen


@pytest.mark.parametrize("fails_in", ["plan_prefill", "on_reserved"])
def test_a_placement_that_raises_after_its_booking_gives_the_booking_back(fails_in):
    """A fault between the reservation and the end of the placement (the P/D pricing's UnboundLocalError, 2026-12-06)
    fails the call open: Envoy routes the request without the brain's header, and no access-log entry will ever
    name the reservation. It must not stay charged to the replica for the hour of reservation_timeout_s."""
    router, t = pd_router(4)
    busy(router, t, ("r1", "r2", "r3"))

    def boom(*_a, **_k):
        raise UnboundLocalError("kp")

    setattr(router.policy, fails_in, boom)
    with pytest.raises(UnboundLocalError):
        router.select(long_prompt(), t)
    assert router.open_reservations == 0
    assert all(r.in_flight_requests == 0 and r.wlc_milli == 0 for r in router.replicas)


def test_a_long_prompt_beside_running_decodes_goes_to_the_idle_prefill_replica():
    router, t = pd_router(4)
    busy(router, t, ("r1", "r2", "r3"))
    d = router.select(long_prompt(), t)
    assert d.replica.name in ("r1", "r2", "r3")
    assert d.prefill is not None and d.prefill.replica.name == "r0"
    # its prefill is booked where it runs, and the decode replica computes none of it
    st = router.policy.state_of(router.replica("r0"))
    assert st.prefill_busy_until > t and d.prefill_reservation.replica.name == "r0"
    assert d.reservation.transfer_tokens == d.prefill.transfer_tokens > 30_000
    assert d.reservation.prefill_s < 0.1 * d.prefill.prefill_s
    assert router.replica("r0").in_flight_requests == 1
    router.release(d.prefill_reservation, t + 1)
    assert router.replica("r0").in_flight_requests == 0 and st.prefill_busy_until <= t + 1


def test_C3_a_prefill_replica_never_measured_is_priced_as_the_decode_replica_it_would_serve():
    """Prefill replicas see few and short requests: priced among themselves, never measured, they stayed at the
    5,000 tok/s prior beside decode replicas measured at 20,000, and a long prompt beside running streams was
    prefilled locally (tests/integration/test_disaggregation.py failed so on a loaded machine)."""
    def plan(with_peer: bool):
        router, t = pd_router(4)
        busy(router, t, ("r1", "r2", "r3"), running=3)
        for name in ("r1", "r2", "r3"):
            rates = router.policy.state_of(router.replica(name)).rates
            rates.prefill_tokens_per_s, rates.prefill_at = 20_000.0, t
        if not with_peer:  # what pricing the prefill replica among its own role alone did
            router.policy.state_of(router.replica("r0")).rates.prefill_at = t  # "measured", at the prior
        return router.select(long_prompt(), t).prefill

    assert plan(with_peer=True) is not None and plan(with_peer=True).replica.name == "r0"
    assert plan(with_peer=False) is None  # at 5,000 tok/s the leg costs more than the stall it saves


def test_a_prefill_leg_is_priced_with_its_replica_s_own_first_token_overhead():
    """A leg is a whole request on the prefill replica: its API server templates, tokenizes and hashes the prompt
    (~20 ms plus ~20 us a token on real vLLMs), which the local prefill's prediction carries for the decode replica.
    Priced without it, a remote prefill looked that much cheaper than it was."""
    def leg(overhead_s: float):
        router, t = pd_router(4)
        busy(router, t, ("r1", "r2", "r3"), running=1)
        states = router.policy.states
        for name in ("r0", "r1", "r2", "r3"):  # every replica measured: the decode ones with none of their own
            for k in range(8):
                states.observe_overhead(router.replica(name), 1000 * (k + 1), overhead_s if name == "r0" else 0.0, t)
        return router.select(long_prompt(), t).prefill

    assert leg(0.0) is not None and leg(0.0).replica.name == "r0"
    # 40K tokens at the 5,000 tok/s prior: 8 s here, stalling one stream 8 s (16 s), against 10 s by the leg; with the
    # prefill replica's own 7 s on top the leg costs more
    assert leg(7.0) is None


def test_of_two_prefill_replicas_the_leg_goes_where_its_whole_first_token_comes_sooner():
    """The leg's replica is chosen by what its first token takes there, its own overhead included: two idle prefill
    replicas alike but for a slow API server (3 s a request on r0) send the leg to r1."""
    router, t = pd_router(4, prefill=("r0", "r1"))
    busy(router, t, ("r2", "r3"), running=1)
    for name in ("r0", "r1", "r2", "r3"):
        for k in range(8):
            router.policy.states.observe_overhead(router.replica(name), 1000 * (k + 1), 3.0 if name == "r0" else 0.0, t)
    d = router.select(long_prompt(), t)
    assert d.prefill is not None and d.prefill.replica.name == "r1"


def test_on_an_idle_fleet_a_long_prompt_is_prefilled_where_it_is_decoded():
    router, t = pd_router(4)
    d = router.select(long_prompt(), t)
    assert d.prefill is None and d.prefill_reservation is None
    assert router.replica("r0").in_flight_requests == 0


def test_a_short_prompt_stays_local_even_beside_running_decodes():
    router, t = pd_router(4)
    busy(router, t, ("r1", "r2", "r3"))
    assert router.select(long_prompt(tokens=40), t).prefill is None


def test_a_busy_prefill_replica_is_not_worth_its_queue():
    router, t = pd_router(4)
    busy(router, t, ("r1", "r2", "r3"), running=2)
    first = [router.select(long_prompt(session=f"s{i}"), t) for i in range(12)]
    # the prefill replica's queue grows with each leg sent there, until a local prefill costs less
    assert first[0].prefill is not None and any(d.prefill is None for d in first)


@pytest.mark.parametrize("why", ["disabled", "too_long", "messages", "adapter", "picker", "headers_only"])
def test_no_prefill_leg_where_one_cannot_or_must_not_go(why):
    router, t = pd_router(4, enabled=why != "disabled", max_transfer_tokens=1000 if why == "too_long" else None)
    router.disaggregates = why != "picker"  # a picker's gateway carries one request per pick
    busy(router, t, ("r1", "r2", "r3"))
    p = long_prompt(api=Api.MESSAGES if why == "messages" else Api.CHAT)
    if why == "adapter":
        p = dataclasses.replace(p, adapter="tiny-lora-a")
    if why == "headers_only":  # a body too big to send the brain: nothing to send as a prefill leg
        p = dataclasses.replace(p, body_status=BodyStatus.HEADERS_ONLY)
    assert router.select(p, t).prefill is None


def test_the_transfer_rate_is_learned_and_one_stalled_leg_moves_it_little():
    rate = TransferRate(20_000.0)
    rate.observe(1_000_000, 1.0)  # a million tokens a second: clipped to 10x the prior at the first sample
    assert rate.value == 200_000.0
    for _ in range(30):
        rate.observe(100_000, 1.0)
    assert 95_000 < rate.value < 105_000
    rate.observe(100_000, 1000.0)  # a leg that waited behind a queue says nothing much of the link
    assert rate.value > 80_000


def test_roles_are_checked_and_read_from_pod_labels():
    cfg = parse_config({"replicas": [{"name": "p", "url": "http://127.0.0.1:1", "role": "prefill"},
                                     {"name": "d", "url": "http://127.0.0.1:2"}]})
    assert [r.role for r in cfg.replicas] == ["prefill", "both"]
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.role"):
        parse_config({"replicas": [{"name": "p", "url": "http://127.0.0.1:1", "role": "prefil"}]})
    with pytest.raises(ConfigError, match="disaggregation.transfer_tokens_per_s"):
        parse_config({"disaggregation": {"transfer_tokens_per_s": 0}})
    assert pod_role({"metadata": {"labels": {"llm-d.ai/role": "prefill"}}}) == "prefill"
    assert pod_role({"metadata": {"labels": {"llm-d.ai/role": "prefill-decode"}}}) == "both"
    assert pod_role({"metadata": {}}) == "both"


def test_the_legs_bodies_are_what_vllm_s_connectors_read():
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500,
           "stream": True, "stream_options": {"include_usage": True}}
    leg = json.loads(prefill_body(doc))
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["messages"] == doc["messages"]
    params = {"do_remote_prefill": True, "remote_request_id": "x", "remote_host": "h", "remote_port": 1}
    dec = json.loads(decode_body(doc, params))
    assert dec["kv_transfer_params"] == params and dec["stream"] is True and dec["max_completion_tokens"] == 500
    gone = json.loads(decode_body(doc, params, one_token=True))
    assert gone["max_tokens"] == 1 and gone["stream"] is False and "max_completion_tokens" not in gone


def test_a_local_prefill_also_costs_the_streams_that_arrive_during_it():
    """Nothing decodes on the decode replicas now, but requests have been arriving there: a long local prefill would
    stall those that join during it (half of it each, on average), so it goes to the idle prefill replica; the same
    prompt on a fleet nothing arrived at lately stays local."""
    quiet, t = pd_router(2)
    assert quiet.select(long_prompt(), t).prefill is None
    busy_fleet, t = pd_router(2)
    for i in range(60):  # a minute of short requests to r1, each already ended
        d = busy_fleet.select(long_prompt(tokens=200, session=f"a{i}"), t - 59 + i)
        busy_fleet.release(d.reservation, t - 59 + i + 0.5)
    assert busy_fleet.select(long_prompt(), t).prefill is not None


def _pd_brain():
    from ..helpers import live_brain

    cfg = parse_config({"replicas": [{"name": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
                                     {"name": "d0", "url": "http://127.0.0.1:9"}], "routing": {"policy": "warm"}})
    b = live_brain(cfg)
    b.router.on_load("d0", LoadSample(12, 0, 0.3), b.clock())  # streams decoding there
    return b


def _chat_body(tokens: int = 40_000) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4 * tokens}]}).encode()


def test_a_call_that_ends_before_its_prefill_leg_was_sent_gives_both_reservations_back():
    from extproc.brain.legs import Legs

    b = _pd_brain()
    legs = envoy_decide(b, {":path": "/v1/chat/completions", "x-session-id": "s"}, _chat_body())
    assert isinstance(legs, Legs)
    assert b.router.replica("p0").in_flight_requests == 1 and b.router.replica("d0").in_flight_requests == 1
    legs.abandon()  # Envoy closed the call before the brain could even extend its timer
    assert b.router.replica("p0").in_flight_requests == 0 and b.router.replica("d0").in_flight_requests == 0
    assert b.router.open_reservations == 0


def test_a_client_s_own_kv_transfer_params_are_dropped_and_the_brain_disaggregates_as_it_would_without_them():
    """Issue 59: a client's kv_transfer_params made the decode replica connect to a host the client named; they never
    reach an engine now, and the request is the brain's to disaggregate like any other."""
    from extproc.brain.legs import Legs

    b = _pd_brain()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 160_000}],
                       "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9",
                                              "remote_request_id": "victim"}}).encode()
    legs = envoy_decide(b, {":path": "/v1/chat/completions", "x-session-id": "s"}, body)
    assert isinstance(legs, Legs) and "kv_transfer_params" not in legs.doc
    legs.abandon()
    assert b.router.open_reservations == 0