"""The agents' own APIs through Envoy and the brain, spoken by the real SDKs (``anthropic``, ``openai``) to mock
replicas: Messages conversations keep their cache, and every Responses follow-up, retrieval and cancel reaches the
replica whose memory holds its response, even one drained for new work."""

from __future__ import annotations

import anthropic
import openai
import pytest

from extproc.core.apis import parse_minted, replica_tag
from extproc.tools.stack.local import Stack, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration

MODEL = "mock-coder-30b"
SYSTEM = "You are a coding agent working in a large repository. " * 30


@pytest.fixture(scope="module")
def stack():
    s = Stack(3, config=FAST, mock_args=["--speedup", "20", "--responses-store"])
    with s:
        wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"]), 30, "all LIVE")
        yield s


def test_messages_conversations_keep_their_cache_and_errors_come_in_anthropic_s_shape(stack):
    client = anthropic.Anthropic(api_key="unused", base_url=stack.url, max_retries=0)
    for session in ("a", "b"):
        history: list[dict] = []
        prompt = 0  # the last turn's prompt tokens, as the engine counted them
        for turn in range(4):
            history.append({"role": "user", "content": [{"type": "text", "text": f"{session} step {turn} " * 40,
                                                         "cache_control": {"type": "ephemeral"}}]})
            for m in history[:-1]:  # as Claude Code does: only the newest message carries the mark
                for block in m["content"]:
                    block.pop("cache_control", None)
            kw = dict(model=MODEL, max_tokens=8, system=SYSTEM, messages=history,
                      metadata={"user_id": f"user_1_account_2_session_{session}"})
            if turn % 2:
                with client.messages.stream(**kw) as s:
                    msg = s.get_final_message()
            else:
                msg = client.messages.create(**kw)
            if turn:  # the conversation so far came from the replica's cache
                assert msg.usage.cache_read_input_tokens >= prompt * 0.8, (session, turn, msg.usage)
            prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens
            history.append({"role": "assistant", "content": [{"type": "text", "text": msg.content[0].text}]})
    assert client.messages.count_tokens(model=MODEL, messages=history).input_tokens > 100
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and "no-such-model" in e.value.body["error"]["message"]


def _holder(response_id: str) -> str:
    tag = parse_minted(response_id)[0]
    return next(n for n in ("r0", "r1", "r2") if replica_tag(n) == tag)


def test_every_responses_follow_up_reaches_the_replica_holding_its_response_even_drained(stack):
    client = openai.OpenAI(api_key="unused", base_url=stack.url + "/v1", max_retries=0)
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input="start " * 40, max_output_tokens=8)
    home = _holder(first.id)
    stack.admin_post(f"/replicas/{home}/drain")
    try:
        # new conversations go elsewhere now; this one can only go on where its responses live
        for k in range(4):
            assert _holder(client.responses.create(model=MODEL, input=f"other {k}", max_output_tokens=2).id) != home
        prev = first
        for turn in range(4):
            kw = dict(model=MODEL, instructions=SYSTEM, input=f"turn {turn} " * 20, previous_response_id=prev.id,
                      max_output_tokens=8)
            if turn % 2:
                done = [e for e in client.responses.create(stream=True, **kw) if e.type == "response.completed"]
                nxt = done[0].response
            else:
                nxt = client.responses.create(**kw)
            assert _holder(nxt.id) == home
            assert nxt.usage.input_tokens_details.cached_tokens > 0.8 * prev.usage.input_tokens
            prev = nxt
        assert client.responses.retrieve(first.id).status == "completed"
        # the holder's own answer: a finished response cannot be cancelled (any other replica: not found)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.cancel(prev.id)
        assert "Cannot cancel a synchronous response" in str(e.value)
    finally:
        stack.admin_post(f"/replicas/{home}/undrain")
    with pytest.raises(openai.NotFoundError):  # a response no replica holds: the engine's own answer
        client.responses.retrieve("resp_never_made")


def test_background_responses_are_polled_and_cancelled_on_the_replica_that_runs_them(stack):
    client = openai.OpenAI(api_key="unused", base_url=stack.url + "/v1", max_retries=0)
    quick = client.responses.create(model=MODEL, input="poll me " * 30, max_output_tokens=8, background=True)
    slow = client.responses.create(model=MODEL, input="cancel me " * 30, max_output_tokens=4000, background=True)
    assert quick.status == slow.status == "queued"
    home = _holder(quick.id)
    stack.admin_post(f"/replicas/{home}/drain")
    try:
        assert client.responses.cancel(slow.id).status == "cancelled"
        wait_for(lambda: client.responses.retrieve(quick.id).status == "completed", 30, "the background response")
        assert client.responses.retrieve(slow.id).status == "cancelled"
    finally:
        stack.admin_post(f"/replicas/{home}/undrain")


def test_the_live_replay_mixes_the_three_apis_and_reads_each_one_s_answers(stack):
    """The benchmarks' client speaks each API (a session keeps one): every request answered and timed, its
    replica and its cached tokens read from that API's own events."""
    import asyncio

    from extproc.tools.workload.http_replay import APIS, replay
    from extproc.tools.workload.generate import WorkloadConfig

    w = WorkloadConfig(minutes=1.0, sessions_per_min=12, oneshots_per_min=0, projects=2, long_share=0.0,
                       system_tokens=(800, 1200), turns_median=4, think_s_mean=1.0)
    res = asyncio.run(replay(stack.url, w, seed=3, speedup=20, api=lambda r: APIS[r.sid % 3]))
    assert res.sent > 20 and res.lost == 0 and not res.errors
    for k, api in enumerate(APIS):
        mine = [r for r in res.requests if r.sid % 3 == k]
        assert mine, api
        assert all(r.ttft is not None and r.extra.get("served_by") in ("r0", "r1", "r2") for r in mine), api
        assert sum(r.cached_tokens for r in mine) > 0.3 * sum(r.prompt_tokens for r in mine), api
