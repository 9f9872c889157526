"""Issue 62, item 1: each decision's predicted time to first token joined with what Envoy saw of the same request,
and the error per replica in /metrics, /state, /decisions and ``warmroute top``."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from prometheus_client import generate_latest

from extproc.brain.release import entry_of_proto
from extproc.brain.outcomes import WINDOW, Outcomes
from extproc.brain.view import state_of
from extproc.config import parse_config
from extproc.contract import CLIENT_FIRST_TOKEN_TAG, FIRST_TOKEN_TAG, METADATA_NAMESPACE, RESERVATION_HEADER
from extproc.envoy_config.filters import access_log
from extproc.tools.stack.top import Row, Snapshot, text_table

from ..helpers import envoy_decide, live_brain

CFG = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(2)]})
BODY = orjson.dumps({"messages": [{"role": "user", "content": "hello " * 400}], "stream": True})


def decided(b, rid: str):
    out = envoy_decide(b, {"x-session-id": rid, "x-request-id": rid}, BODY)
    answer = out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    res = b.router.reservation(int(answer["reservation"].string_value.split(".")[0]))
    return answer["reservation"].string_value, res


def ended(rid: str, token: str, first_us: str | None, client_us: str | None = None, code: int = 200,
          content_type: str = "text/event-stream", upstream: int | None = None):
    return entry_of_proto(ended_proto(rid, token, first_us, client_us, code, content_type, upstream))


def ended_proto(rid: str, token: str, first_us: str | None, client_us: str | None = None, code: int = 200,
                content_type: str = "text/event-stream", upstream: int | None = None):
    e = al.HTTPAccessLogEntry()
    e.request.request_id = rid
    e.request.request_headers[RESERVATION_HEADER] = token
    e.response.response_code.value = code
    e.response.response_code_details = "via_upstream"
    e.response.response_headers["content-type"] = content_type
    if first_us is not None:
        e.common_properties.custom_tags[FIRST_TOKEN_TAG] = first_us
    if client_us is not None:
        e.common_properties.custom_tags[CLIENT_FIRST_TOKEN_TAG] = client_us
    if upstream is not None:
        e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
        e.common_properties.upstream_remote_address.socket_address.port_value = upstream
    e.common_properties.upstream_request_attempt_count = 1
    return e


def test_the_error_per_replica_is_its_bias_its_mean_absolute_percentage_and_its_p90():
    o = Outcomes()
    for _ in range(9):
        o.join("a", None, 0.2, 0.1)  # predicted twice what it took
    o.join("a", None, 0.1, 0.1)
    e = o.error("a")
    assert e.joined == 10
    assert e.bias == pytest.approx((9 * 0.2 + 0.1) / 1.0 - 1.0)
    assert e.mape == pytest.approx(0.9)
    assert e.p90_abs_error_s == pytest.approx(0.1)
    assert o.error("b") is None
    for _ in range(WINDOW):  # only the last WINDOW count: a replica fixed is seen fixed
        o.join("a", None, 0.1, 0.1)
    assert o.error("a").mape == 0.0 and o.joined_total["a"] == 10 + WINDOW
    o.forget("a")
    assert o.error("a") is None


def test_a_streamed_request_s_first_token_is_joined_with_its_prediction_and_shown_everywhere():
    b = live_brain(CFG)
    token, res = decided(b, "q1")
    predicted = res.predicted_ttft_s
    assert predicted is not None and predicted > 0
    b.releaser.on_entry(ended("q1", token, str(int(predicted * 2e6)), str(int(predicted * 2e6) + 5000)))
    assert res.released
    err = b.releaser.outcomes.error(res.replica.name)
    assert err.joined == 1 and err.bias == pytest.approx(-0.5, abs=1e-3)  # predicted half of what it took
    row = b.recent_decisions(request_id="q1")[0]
    assert row["observed_ttft_s"] == pytest.approx(predicted * 2, abs=1e-4)
    assert row["observed_client_ttft_s"] == pytest.approx(predicted * 2 + 0.005, abs=1e-4)
    assert row["predicted_prefill_s"] is not None and row["predicted_prefill_s"] <= row["predicted_ttft_s"]
    state = {r["name"]: r for r in state_of(b)["replicas"]}
    assert state[res.replica.name]["prediction_error"]["joined"] == 1
    other = next(n for n in state if n != res.replica.name)
    assert state[other]["prediction_error"] is None
    text = generate_latest(b.registry).decode()
    assert f'warmroute_ttft_prediction_joined_total{{replica="{res.replica.name}"}} 1.0' in text
    assert f'warmroute_ttft_prediction_bias{{replica="{res.replica.name}"}} -0.5' in text
    assert f'warmroute_ttft_prediction_mape{{replica="{res.replica.name}"}}' in text
    assert f'warmroute_ttft_prediction_joined_total{{replica="{other}"}} 0.0' in text


@pytest.mark.parametrize("why", ["not_streamed", "error", "no_tag", "retried_elsewhere"])
def test_what_is_no_observation_of_the_chosen_replica_s_first_token_is_not_joined(why):
    b = live_brain(CFG)
    b.releaser.by_address = {"127.0.0.1:8001": "r0", "127.0.0.1:8002": "r1"}
    token, res = decided(b, "q1")
    elsewhere = 8002 if res.replica.name == "r0" else 8001
    entry = {
        # a whole completion's body starts with its last token
        "not_streamed": ended("q1", token, "120000", content_type="application/json"),
        "error": ended("q1", token, "120000", code=500),
        "no_tag": ended("q1", token, None),  # an Envoy config rendered before the tags; or Envoy wrote "-"
        "retried_elsewhere": ended("q1", token, "120000", upstream=elsewhere),
    }[why]
    b.releaser.on_entry(entry)
    assert res.released  # released all the same
    assert b.releaser.outcomes.error(res.replica.name) is None
    assert b.recent_decisions(request_id="q1")[0]["observed_ttft_s"] is None


def test_envoy_writes_a_dash_for_a_time_that_never_came_and_it_joins_nothing():
    b = live_brain(CFG)
    token, res = decided(b, "q1")
    b.releaser.on_entry(ended("q1", token, "-"))
    assert b.releaser.outcomes.error(res.replica.name) is None
    token, res = decided(b, "q2")
    b.releaser.on_entry(ended("q2", token, "9" * 5000))  # not Envoy's: past Python's int() digit limit, ignored
    assert res.released and b.releaser.outcomes.error(res.replica.name) is None


def test_the_shipped_access_log_asks_envoy_for_both_first_token_times():
    # over gRPC (a brain reached over TCP): as custom tags
    tcp = dataclasses.replace(CFG, brain=dataclasses.replace(CFG.brain, grpc_socket=None, grpc_port=9100))
    tags = {t["tag"]: t["value"] for t in access_log(tcp)[0]["typed_config"]["common_config"]["custom_tags"]}
    assert tags[FIRST_TOKEN_TAG] == "%COMMON_DURATION(US_TX_END:US_RX_BODY_BEG:us)%"
    assert tags[CLIENT_FIRST_TOKEN_TAG] == "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%"
    # at the log door (by its Unix socket): as the record's fields
    record = access_log(CFG)[0]["typed_config"]["record"]
    assert record["ft"] == tags[FIRST_TOKEN_TAG] and record["cft"] == tags[CLIENT_FIRST_TOKEN_TAG]


def test_the_picker_front_s_own_first_token_is_joined_too():
    b = live_brain(CFG)
    token, res = decided(b, "q1")
    b.picks.end(res, None, False, 0.25)
    assert b.releaser.outcomes.error(res.replica.name).joined == 1


def test_top_shows_each_replica_s_bias_and_error():
    rows = [Row("r0", "LIVE", False, 0.0, 1.0, 0.0, 1.0, 3, 0, 0.5, 0.5, None, "vllm", 10,
                prediction_error={"joined": 40, "bias": 0.12, "mape": 0.25, "p90_abs_error_s": 0.05}),
            Row("r1", "LIVE", False, 0.0, 1.0, 0.0, 1.0, 3, 0, 0.5, 0.5, None, "vllm", 10)]
    text = text_table(Snapshot(rows, 10, 10, 0, 0, 0, {}, [], "warm", 10), 160)
    lines = text.splitlines()
    assert "+12%/25%" in lines[1].split() and "-" in lines[2].split()


def _warm(n=3):
    from extproc.core import HealthConfig, RouterConfig

    from ..helpers import live_router

    return live_router(n, RouterConfig(policy="warm", health=HealthConfig(stale_scrape_intervals=1e9)))


def _turn(router, t, session, tokens=2_000):
    from ..helpers import chain, prof

    return router.select(prof(session=session, tokens=tokens, blocks=chain("sys", session, tokens)), t)


def test_issue62_a_replica_s_first_token_overhead_is_learned_from_what_envoy_saw_and_corrects_its_predictions():
    router, t = _warm(3)
    before = []
    for i in range(12):  # each first token took 25 ms beyond the cost model's prediction
        d = _turn(router, t + i, f"s{i}")
        before.append(d.predicted_ttft_s)
        router.first_token_observed(d.reservation, d.predicted_ttft_s - d.reservation.overhead_s + 0.025, t + i + 0.5)
        router.release(d.reservation, t + i + 1)
    d = _turn(router, t + 20, "s-next")
    assert d.reservation.overhead_s == pytest.approx(0.025, abs=1e-6)  # in the prediction now
    assert before[0] is not None and router.policy.state_of(router.replicas[0]).overhead.line is not None


def test_issue62_a_replica_never_measured_is_priced_at_its_peers_overhead_and_an_old_reading_drifts_to_it():
    from extproc.core.warm import OVERHEAD_HALF_LIFE_S

    router, t = _warm(3)
    pol = router.policy
    r0, r1, r2 = router.replicas
    for _ in range(10):
        pol.state_of(r0).overhead.add(1000, 0.020, t)
        pol.state_of(r1).overhead.add(1000, 0.030, t)
    pol.on_first_token(_FakeRes(r1, 1000), 0.030, t)  # the fleet's level is recomputed as samples come
    assert pol.states.overhead_of(r2, t, 1000) == pytest.approx(0.030)  # never measured: its peers' (median) level
    for _ in range(10):
        pol.state_of(r2).overhead.add(1000, 0.500, t)  # a slow API server, measured once
    pol.on_first_token(_FakeRes(r2, 1000), 0.500, t)
    assert pol.states.overhead_of(r2, t, 1000) == pytest.approx(0.5, abs=0.01)
    queued = _FakeRes(r0, 1000)
    queued.predicted_ttft_s = 1.0  # of which 1 s predicted waiting behind others: the queue model's error, not r0's
    samples = len(pol.state_of(r0).overhead.samples)
    pol.on_first_token(queued, 3.0, t)
    assert len(pol.state_of(r0).overhead.samples) == samples
    level = pol.states.overhead_of(r2, t + 1e9, 1000)
    assert level == pytest.approx(0.030)
    # no traffic since: after a half-life, halfway back to its peers (it is not kept off forever by one reading)
    assert pol.states.overhead_of(r2, t + OVERHEAD_HALF_LIFE_S, 1000) == pytest.approx((0.5 + level) / 2, abs=0.01)


def test_issue62_the_overhead_grows_with_the_prompt_as_the_api_server_s_work_does_and_shrugs_off_an_outlier():
    from extproc.core.warm_replica import Overhead, overhead_at

    o = Overhead()
    for k in range(40):
        tokens = 1000 + 100 * k
        o.add(tokens, 0.010 + 20e-6 * tokens, 0.0)  # 10 ms, and 20 us a prompt token
    o.add(3000, 5.0, 0.0)  # one queue the model got badly wrong
    a, b = o.line
    assert b == pytest.approx(20e-6, rel=0.1) and a == pytest.approx(0.010, abs=0.005)
    assert overhead_at(o.line, 5000) == pytest.approx(0.110, abs=0.01)
    short = Overhead()
    for _ in range(10):
        short.add(2000, -0.050, 0.0)  # predicted too slow: no negative overhead
    assert overhead_at(short.line, 2000) == 0.0


class _FakeRes:
    """A reservation of ``replica`` whose prediction (without overhead) was 0: the whole observed time is overhead."""

    def __init__(self, replica, prompt_tokens=0):
        self.replica, self.predicted_ttft_s, self.overhead_s, self.remote, self.transfer_tokens = replica, 0.0, 0.0, False, 0
        self.pending_tokens, self.prefill_s, self.wait_s, self.engine = prompt_tokens, 0.0, 0.0, None


def test_issue62_the_brain_learns_the_overhead_from_the_access_log_join():
    b = live_brain(CFG)
    names = set()
    for i in range(20):
        token, res = decided(b, f"q{i}")
        names.add(res.replica.name)
        model_part = res.predicted_ttft_s - res.overhead_s
        b.releaser.on_entry(ended(f"q{i}", token, str(int((model_part + 0.03) * 1e6))))
    pol = b.router.policy
    learned = [pol.state_of(b.router.replica(n)).overhead.line for n in names]
    assert all(v is not None and v[0] == pytest.approx(0.03, abs=1e-3) for v in learned)
    # the predictions made since carry it: the last joined ones were right to the millisecond, the first 30 ms short
    last = [b.releaser.outcomes.by_replica[n][-1] for n in names]
    first = [b.releaser.outcomes.by_replica[n][0] for n in names]
    assert all(abs(p - o) < 1e-3 for p, o in last) and all(o - p == pytest.approx(0.03, abs=1e-3) for p, o in first)


def test_issue62_a_replica_s_own_overhead_predicts_its_first_token_but_the_choice_prices_the_fleet_s_level():
    """Fitted on 64 requests, like replicas' overheads differ by noise; priced per replica they drew new sessions to
    whichever fitted lowest (real vLLMs: p50 1.22x ring hash's). So new sessions keep spreading over both."""
    router, t = _warm(2)
    pol = router.policy
    r0, r1 = router.replicas
    for _ in range(10):
        pol.state_of(r0).overhead.add(2000, 0.001, t)
        pol.state_of(r1).overhead.add(2000, 0.300, t)
    pol.on_first_token(_FakeRes(r0, 2000), 0.001, t)
    went = set()
    for i in range(6):
        from ..helpers import chain, prof

        d = router.select(prof(session=f"new-{i}", tokens=2000, blocks=chain(f"sys{i}", f"new-{i}", 2000)), t + i)
        went.add(d.replica.name)
        if d.replica is r1:
            assert d.reservation.overhead_s == pytest.approx(0.300, abs=0.01)  # its own, in its prediction
        router.release(d.reservation, t + i + 0.5)
    assert went == {"r0", "r1"}


def test_the_simulator_times_a_prediction_from_its_decision_as_the_brain_s_join_does():
    """Time a request spent held by flow control comes before its decision: no part of the predicted TTFT, as Envoy's
    upstream first token (the brain's join) does not see it either. Counted, a fleet that holds would read as a badly
    under-predicting one."""
    from extproc.tools.sim.simulator import SimResult
    from extproc.tools.workload.generate import Request

    def req(rid: int, held_s: float, ttft: float) -> Request:
        r = Request(rid=rid, sid=rid, project=0, prompt_tokens=1000, system_tokens=0, max_tokens=8, arrival=100.0,
                    ttft=ttft)
        r.extra["predicted_ttft"] = (0.5, held_s)
        return r

    got = SimResult._prediction_error(None, [req(1, 4.5, 5.0), req(2, 0.0, 0.5)])  # type: ignore[arg-type]
    assert got["ttft_pred_mape"] == pytest.approx(0.0) and got["ttft_pred_bias"] == pytest.approx(0.0)
    got = SimResult._prediction_error(None, [req(1, 0.0, 1.0)])  # type: ignore[arg-type]
    assert got["ttft_pred_mape"] == pytest.approx(0.5) and got["ttft_pred_bias"] == pytest.approx(-0.5)


def test_issue62_a_periodic_entry_that_has_seen_the_first_token_ends_its_request_s_prefill_in_the_queue():
    b = live_brain(CFG)
    token, res = decided(b, "long")
    st = b.router.policy.states.of(res.replica)
    booked = st.prefill_busy_until
    assert booked > b.clock() and st.pending_tokens > 0
    alive = ended_proto("long", token, None)  # its body has not begun: a periodic entry of a request still prefilling
    alive.common_properties.access_log_type = al.AccessLogType.DownstreamPeriodic
    b.on_log_entry(entry_of_proto(alive))
    assert st.prefill_busy_until == booked and not res.released
    alive.common_properties.custom_tags[FIRST_TOKEN_TAG] = "40000"  # now it has: its prefill is over
    b.on_log_entry(entry_of_proto(alive))
    assert st.prefill_busy_until < booked and st.pending_tokens == 0 and not res.released
