"""``make bench-apis``: the agents' APIs on real vLLM 0.32 replicas, through Envoy and warmroute, spoken by the real
SDKs (``openai`` for chat and Responses, ``anthropic`` for Messages).

Three replicas with the Responses store on (``VLLM_ENABLE_RESPONSES_API_STORE=1``). The same conversations (the
same system prompt and user turns, greedy decoding) are run once per API, each API's 10 conversations at once, from
cold caches (``POST /reset_prefix_cache``): chat completions (session header), Anthropic Messages (half with the
session header, half by ``metadata.user_id``), Responses chained by ``previous_response_id`` (half with the
session header, half without). Printed: client errors, follow-ups that landed on the replica holding their
response (read from the id the brain minted, and proved by the engine: any other replica answers 404), and per turn
the engine-reported cached prompt tokens of each API against chat's on the same conversations.

Targets (issue 32): 0 client errors, every follow-up on its holder, cached tokens per turn within 5% of chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import reset_caches
from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Stack

SYSTEM = ("You are a coding agent in a large Python repository. Read before you write, keep the style of the code "
          "around you, run the tests you touch, and explain each change in one sentence. ") * 16
APIS = ("chat", "messages", "responses")


def user_turn(conversation: int, turn: int) -> str:
    return f"Conversation {conversation}, step {turn}: look at module_{conversation}_{turn}.py and " + \
        " ".join(f"fix item {turn * 7 + k} of {conversation}" for k in range(12))


async def _parsed(raw):
    """A raw response's object (the anthropic SDK's async parse is a coroutine, openai's is not)."""
    out = raw.parse()
    return await out if inspect.isawaitable(out) else out


async def _chat(client, model: str, k: int, turns: int, out_tokens: int, log: list) -> None:
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        msgs.append({"role": "user", "content": user_turn(k, t)})
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=msgs, max_tokens=out_tokens, temperature=0,
            extra_headers={"x-session-id": f"chat-{k}"})
        r = await _parsed(raw)
        details = r.usage.prompt_tokens_details
        log.append((k, t, r.usage.prompt_tokens, details.cached_tokens if details else 0, None,
                    raw.headers.get("x-request-id")))
        msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})


async def _messages(client, model: str, k: int, turns: int, out_tokens: int, log: list) -> None:
    msgs: list[dict] = []
    by_header = k % 2 == 0
    for t in range(turns):
        msgs.append({"role": "user", "content": [{"type": "text", "text": user_turn(k, t),
                                                  "cache_control": {"type": "ephemeral"}}]})
        for m in msgs[:-1]:  # Claude Code marks only its newest message
            for b in m["content"]:
                b.pop("cache_control", None)
        kw = {"extra_headers": {"x-session-id": f"messages-{k}"}} if by_header else \
            {"metadata": {"user_id": f"user_0_account_0_session_{k}"}}
        # the SDK (2.x) has no temperature parameter any more; vLLM's Messages request still reads one
        raw = await client.messages.with_raw_response.create(model=model, max_tokens=out_tokens, system=SYSTEM,
                                                             messages=msgs, extra_body={"temperature": 0}, **kw)
        r = await _parsed(raw)
        cached = r.usage.cache_read_input_tokens or 0  # the prompt: input + cache read + cache creation
        prompt = r.usage.input_tokens + cached + (r.usage.cache_creation_input_tokens or 0)
        log.append((k, t, prompt, cached, None, raw.headers.get("x-request-id")))
        text = "".join(b.text for b in r.content if b.type == "text")
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": text}]})


async def _responses(client, model: str, k: int, turns: int, out_tokens: int, log: list) -> None:
    prev = None
    headers = {"x-session-id": f"responses-{k}"} if k % 2 == 0 else {}
    for t in range(turns):
        raw = await client.responses.with_raw_response.create(
            model=model, instructions=SYSTEM, input=user_turn(k, t), previous_response_id=prev.id if prev else None,
            temperature=0, max_output_tokens=out_tokens, extra_headers=headers)
        r = await _parsed(raw)
        details = r.usage.input_tokens_details
        log.append((k, t, r.usage.input_tokens, details.cached_tokens if details else 0,
                    (prev.id if prev else None, r.id), raw.headers.get("x-request-id")))
        prev = r


async def run_api(api: str, url: str, model: str, conversations: int, turns: int, out_tokens: int) -> dict:
    import anthropic
    import openai

    log: list = []
    errors: list[str] = []
    if api == "messages":
        client = anthropic.AsyncAnthropic(api_key="unused", base_url=url, max_retries=0, timeout=300)
        run = _messages
    else:
        client = openai.AsyncOpenAI(api_key="unused", base_url=url + "/v1", max_retries=0, timeout=300)
        run = _chat if api == "chat" else _responses

    async def one(k: int) -> None:
        try:
            await run(client, model, k, turns, out_tokens, log)
        except Exception as e:  # a client error ends that conversation; it is counted, not raised
            # its kind and status only: an engine's error message may quote the request (vLLM's validation errors do)
            errors.append(f"{type(e).__name__} {getattr(e, 'status_code', '')}".strip())

    t0 = time.monotonic()
    await asyncio.gather(*(one(k) for k in range(conversations)))
    await client.close()
    return {"log": log, "errors": errors, "seconds": time.monotonic() - t0}


def holders_kept(log: list) -> tuple[int, int]:
    """(follow-ups whose response the brain placed on the replica holding the one they follow, follow-ups)."""
    from extproc.core.apis import parse_minted

    ok = total = 0
    for *_, ids, _ in log:
        if ids and ids[0]:
            total += 1
            a, b = parse_minted(ids[0]), parse_minted(ids[1])
            ok += bool(a and b and a[0] == b[0])
    return ok, total


def per_turn(log: list, turns: int) -> list[tuple[float, float]]:
    """Per turn: mean prompt tokens and mean cached tokens over the conversations."""
    out = []
    for t in range(turns):
        rows = [(p, c) for (_, tt, p, c, *_) in log if tt == t]
        out.append((statistics.fmean(p for p, _ in rows) if rows else float("nan"),
                    statistics.fmean(c for _, c in rows) if rows else float("nan")))
    return out


def cache_lost(log: list) -> int:
    """Follow-ups whose engine-reported cached tokens were under half the previous turn's prompt."""
    prompts = {(k, t): p for (k, t, p, *_) in log}
    return sum(1 for (k, t, _, c, *_) in log if t and (k, t - 1) in prompts and c < 0.5 * prompts[(k, t - 1)])


def predicted_within_a_block(log: list, predicted: dict[str, int], block: int = 128) -> tuple[int, int]:
    """(follow-ups whose brain-predicted cached tokens were within one engine block, or 5% of the prompt, of what
    the engine reported; follow-ups with a decision found)."""
    ok = total = 0
    for (_k, t, prompt, cached, _, rid) in log:
        if t and rid in predicted:
            total += 1
            ok += abs(predicted[rid] - cached) <= max(block, 0.05 * prompt)
    return ok, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=10, help="per API, at once")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=3)
    args = ap.parse_args(argv)
    why = real_vllm.available()
    if why:
        print(why, file=sys.stderr)
        return 1
    model = real_vllm.model_info()["served_name"]
    opts = real_vllm.VllmOptions(lora=(), responses_store=True, dev_mode=True, kv_bytes=128 << 20)
    results = {}
    with tempfile.TemporaryDirectory(prefix="warmroute-bench-apis-") as d:
        s = Stack(args.replicas, config={"health": {"scrape_interval_s": 1.0, "probing_clean_window_s": 2.0}},
                  real_vllm=opts, workdir=Path(d))
        with s:
            s.wait_all_live(120)
            urls = [r.url for r in s.replicas]
            for api in APIS:
                reset_caches(urls)
                results[api] = asyncio.run(run_api(api, s.url, model, args.conversations, args.turns,
                                                   args.output_tokens))
                r = results[api]
                r["predicted"] = {}
                for row in r["log"]:  # what the brain predicted for each request (GET /decisions)
                    got = json.loads(s.admin_get(f"/decisions?request_id={row[5]}"))["decisions"] if row[5] else []
                    if got and got[-1]["predicted_cached_tokens"] is not None:
                        r["predicted"][row[5]] = got[-1]["predicted_cached_tokens"]
                print(f"{api}: {len(r['log'])} requests in {r['seconds']:.0f} s, {len(r['errors'])} client errors"
                      + (f" (first: {r['errors'][0]})" if r["errors"] else ""), flush=True)
    turns = {api: per_turn(results[api]["log"], args.turns) for api in APIS}
    print(f"\ncached prompt tokens per turn (mean over {args.conversations} conversations), and against chat's:")
    print(f"{'turn':>4} {'prompt':>7} {'chat':>7} {'messages':>9} {'ratio':>6} {'responses':>9} {'ratio':>6}")
    worst = {"messages": 0.0, "responses": 0.0}
    for t in range(args.turns):
        p, c = turns["chat"][t]
        cells = []
        for api in ("messages", "responses"):
            ca = turns[api][t][1]
            ratio = ca / c if c else float("nan")
            if c and t:  # the first turn is the shared system prompt, cached or not by arrival order
                worst[api] = max(worst[api], abs(ratio - 1))
            cells.append(f"{ca:9.0f} {ratio:6.3f}")
        print(f"{t:4d} {p:7.0f} {c:7.0f} " + " ".join(cells))
    print("\nover turns 2+, cached tokens against chat's: " + ", ".join(
        f"{a} {_cached(turns, a, args.turns) / max(1.0, _cached(turns, 'chat', args.turns)):.3f}x"
        for a in ("messages", "responses")))
    print("follow-ups that found less than half their conversation cached (the session moved, or was evicted): " +
          ", ".join(f"{a} {cache_lost(results[a]['log'])}" for a in APIS))
    print("follow-ups whose predicted cached tokens were within one engine block (or 5%) of the engine's: " +
          ", ".join("{} {}/{}".format(a, *predicted_within_a_block(results[a]["log"], results[a]["predicted"]))
                    for a in APIS))
    ok, total = holders_kept(results["responses"]["log"])
    errors = sum(len(results[a]["errors"]) for a in APIS)
    print(f"\nclient errors: {errors}; Responses follow-ups on the replica holding their response: {ok}/{total}")
    print("worst single turn against chat's (turns 2+): " +
          ", ".join(f"{a} {100 * w:.1f}%" for a, w in worst.items()) + " (target: within 5%)")
    return 0 if errors == 0 and ok == total else 1


if __name__ == "__main__":
    sys.exit(main())


def _cached(turns, api: str, n: int) -> float:
    """An API's cached tokens summed over turns 2 to ``n``."""
    return sum(turns[api][t][1] for t in range(1, n))
