"""What estimating costs, in the simulator (issue 45): texts of different token scales, a router that counts from
the text against one that has the engine's tokens and its KV events (``warmroute_exact``), and llm-d's precise
scorer as a peer."""

from __future__ import annotations

from dataclasses import replace

from extproc.core.blocks import BLOCK_TOKENS as BLOCK
from extproc.tools.engine.model import Engine, EngineRequest
from extproc.tools.sim.peers import LlmdPrecise
from extproc.tools.sim.simulator import Simulation
from extproc.tools.workload.generate import Request, Workload, WorkloadConfig


def _requests(cfg: WorkloadConfig, seed: int = 3) -> list[Request]:
    sim = Simulation("warmroute_no_flow", replicas=4, workload=cfg, seed=seed)
    return sim.run().requests


def test_scales_change_what_a_router_counts_and_nothing_the_engines_see():
    base = WorkloadConfig(minutes=3)
    plain, scaled = _requests(base), _requests(replace(base, token_scale=(1.2, 1.9)))
    def turns(reqs: list[Request]) -> dict:
        seen: dict[int, int] = {}
        out = {}
        for r in sorted(reqs, key=lambda x: x.arrival):
            seen[r.sid] = seen.get(r.sid, 0) + 1
            out[r.sid, seen[r.sid]] = r.prompt_tokens
        return out

    a, b = turns(plain), turns(scaled)
    common = a.keys() & b.keys()
    assert len(common) > 0.9 * len(a) and all(a[k] == b[k] for k in common)  # the same workload
    assert all(r.estimated() == (r.prompt_tokens, r.blocks()[: r.prompt_tokens // BLOCK]) for r in plain)
    for r in scaled:
        tokens, blocks = r.estimated()
        assert 1.2 * tokens - 2 <= r.prompt_tokens <= 1.9 * tokens + 2, (r.prompt_tokens, tokens)
        assert len(blocks) == tokens // BLOCK
    # one text, one scale: a session's turns and a project's system prompt keep theirs
    by_session = {}
    for r in scaled:
        assert by_session.setdefault(r.sid, r.text_scale) == r.text_scale
    assert len({round(r.sys_scale, 6) for r in scaled}) > 1


def test_exact_mode_predicts_the_engine_s_cached_tokens_where_the_estimate_cannot():
    """Under the estimate's error, warmroute counting from the text misses the engine's cached tokens by the scale
    it learned; with the engine's tokens and its events the prediction is the engine's own (but for what the
    engine did between the decision and the admission: a queue, an eviction). Every body read (the ``_body`` rows): a
    turn decided at its headers is priced by its session's pin in either mode, the engine's tokens being in its body."""
    cfg = WorkloadConfig(minutes=6, token_scale=(1.2, 1.9))

    def exact_share(policy: str) -> float:
        reqs = Simulation(policy, replicas=4, workload=cfg, seed=2).run().requests
        done = [r for r in reqs if "predicted_cached" in r.extra and r.error is None and r.ttft is not None]
        return sum(r.extra["predicted_cached"] == r.cached_tokens for r in done) / len(done)

    estimate, exact = exact_share("warmroute_body"), exact_share("warmroute_exact_body")
    assert exact >= 0.95 and exact > estimate + 0.2, (exact, estimate)


def test_llmd_precise_scores_the_engine_s_blocks_and_its_speculative_entries():
    class Sim:
        engines = [Engine(), Engine()]
        alive = [True, True]

    p = LlmdPrecise(2, seed=1)
    p.attach(Sim)
    w = Workload(WorkloadConfig(), 1)
    r = w.oneshot(0.0)
    # pod 1's engine holds the prompt's blocks; equal queues and KV: pod 1 wins on its prefix score
    e = Sim.engines[1]
    e._admit(EngineRequest(r.rid, r.blocks(), r.prompt_tokens, 8, 0.0))
    assert p.choose(r, 0.0) == 1
    # a request sent to pod 0 counts there for 2 s (speculativeTTL) before its engine says anything
    r2 = replace(w.oneshot(0.0), _blocks=None, _estimate=None)
    p.speculative[0].add(r2.blocks()[: r2.prompt_tokens // BLOCK], 10.0)
    assert p.choose(r2, 10.5) == 0
    assert p.speculative[0].run(Sim.engines[0], r2.blocks()[:4], 12.5) == 0  # expired


def test_the_simulated_brain_learns_the_engines_tokens_per_estimated_token():
    """The simulator's engines report how many requests their prompt tokens count (as vLLM's first-token count
    does), so a brain that estimates from text learns each replica's scale, as it does in front of real engines."""
    sim = Simulation("warmroute", replicas=4, workload=WorkloadConfig(minutes=4, token_scale=(1.2, 1.9)), seed=1)
    sim.run()
    scales = [sim.policy.router.policy.state_of(r).scale for r in sim.policy.router.replicas]
    assert all(s.learned and 1.2 <= s.value <= 1.9 for s in scales), [(s.learned, s.value) for s in scales]


def test_llmd_token_aware_sticks_to_the_cached_endpoint_until_its_backlog_passes_the_penalty():
    """llm-d's default since mid-2026 ("sticky until saturated"), as its source and Dynamo's port test it: a cached
    endpoint keeps the request despite a backlog within maxTTFTPenaltyMs; past it, the lighter token load wins; the
    in-flight tokens go at the first token."""
    from extproc.tools.sim.peers import LlmdTokenAware

    def req(rid: int, sid: int) -> Request:
        return Request(rid, sid, 0, 20_000, 1_000, 8, 0.0)

    p = LlmdTokenAware(2, seed=1)
    first = req(1, 7)
    home = p.choose(first, 0.0)
    other = 1 - home
    assert p.tokens[home] == 20_000  # its uncached prompt, in flight until its first token
    p.first_token(first, 0.5)
    assert p.tokens == [0, 0]
    p.tokens[home] = int(0.5 * p.PENALTY_S * p.peak_tps)  # half the allowance of backlog: it stays
    assert p.choose(req(2, 7), 1.0) == home
    p.tokens[home] = int(2 * p.PENALTY_S * p.peak_tps)  # twice the allowance: stickiness breaks
    assert p.choose(req(3, 7), 2.0) == other
