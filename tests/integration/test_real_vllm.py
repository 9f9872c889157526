"""warmroute in front of real vLLM 0.32 engines (CPU, the tiny model `make engines` builds), through Envoy.

What only a real engine can say: how its tokenizer and chat template count a prompt and which whole blocks its
prefix cache hits (the brain's predicted cached tokens against the engine's ``usage.prompt_tokens_details``), the
metric families and label sets it really exports, its model list with adapters loaded and unloaded at run time,
its 404 for an unknown model, its routes in /openapi.json, and what a SIGKILL does to its port and streams.

One fleet for the module, started side by side (~100 s on two cores: each engine's processes import torch and
vLLM anew): r0 serves tiny-llama with both adapters, r1 tiny-llama with one adapter and run-time LoRA updating,
r2 the same weights as another model (tiny-coder) on two data-parallel engines behind one port (~3.9 GB), r3
tiny-llama started with --disable-log-stats. r0 and r1 publish KV events (r1 with another PYTHONHASHSEED), and the
brain has tiny-llama's tokenizer: r0 is priced in exact mode, r1 estimated. r0-r2's engine is "auto"; r3 is configured
as vllm, so that it
says what is missing. The tiny-llama replicas keep stored Responses (VLLM_ENABLE_RESPONSES_API_STORE=1).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import aiohttp
import pytest

from extproc.brain.scraper import VLLM, parse_metrics
from extproc.tools.stack import real_vllm
from extproc.tools.stack.real_vllm import VllmOptions
from extproc.tools.workload.http_replay import system_texts
from extproc.tools.stack.local import Stack, http_get, wait_for

from .conftest import FAST, quiet

pytestmark = [pytest.mark.integration, pytest.mark.real_engine]

MODEL = "tiny-llama"
# a decode prior far from the engine's (~30 ms a token here), so that the rates test sees it learned, not kept
# requests may carry tools (vLLM refuses tools without a parser for the default tool_choice, "auto")
TOOL_CALLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
# x-model: this fleet serves several models, so a turn under way is decided at its headers only when it names its
# model in a header (issue 61); the other tests name none and read every body
CONFIG = {**FAST, "health": {**FAST["health"], "scrape_interval_s": 0.5}, "warm": {"decode_s_per_token": 0.2},
          "profile": {"model_header": "x-model"}}


def _doc(raw: bytes) -> dict:
    try:
        return json.loads(raw or b"{}")
    except ValueError:  # vLLM's LoRA endpoints answer in plain text
        return {"text": raw.decode(errors="replace")}


def post(url: str, path: str, doc: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(doc).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), _doc(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), _doc(e.read())


def metrics_of(port: int) -> str:
    return http_get(f"http://127.0.0.1:{port}/metrics", 5).decode()


def series(text: str, name: str) -> list[tuple[dict, float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = {}
            if line[len(name)] == "{":
                body = line[len(name) + 1:line.rindex("}")]
                for part in body.split('",'):
                    if "=" in part:
                        k, v = part.split("=", 1)
                        labels[k.strip()] = v.strip().strip('"')
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def total(text: str, name: str, **want: str) -> float:
    return sum(v for lab, v in series(text, name) if all(lab.get(k) == w for k, w in want.items()))


@pytest.fixture(scope="module")
def fleet():
    why = real_vllm.available()
    if why:
        pytest.fail(f"the real-engine tests need the engine: {why}")
    s = Stack(4, config={**CONFIG, "exact_cache": {"tokenizers": {MODEL: str(real_vllm.model_dir())}}},
              real_vllm=VllmOptions(responses_store=True, kv_events=True, extra=TOOL_CALLS, dev_mode=True))
    # r1's engine hashes its blocks with another seed (PYTHONHASHSEED): its events cannot verify, it stays estimated
    s.vllm_options = {"r1": VllmOptions(lora=("tiny-lora-a",), runtime_lora=True, responses_store=True,
                                        kv_events=True, hash_seed="7", extra=TOOL_CALLS),
                      "r2": VllmOptions(served_name="tiny-coder", lora=(), data_parallel=2),
                      "r3": VllmOptions(lora=(), log_stats=False, responses_store=True, extra=TOOL_CALLS)}
    s.engines = {f"r{i}": "auto" for i in range(3)}
    # r3 never scrapes well, so its /openapi.json is never read: its paths from the config, as an operator would
    # list them (else a path no replica is known to serve may be r3's, and is not refused)
    paths = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm-0.32" / "openapi-paths.json").read_text())
    s.replica_config = {"r3": {"paths": sorted(paths)}}
    try:
        s.start()
        wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"][:3]), 120, "r0-r2 LIVE")
        yield s
    finally:
        s.stop()


def test_auto_finds_vllm_and_every_family_warmroute_reads_is_there(fleet):
    for r in fleet.state()["replicas"][:3]:
        assert r["engine"] == "auto (vllm)" and r["scrape_error"] is None, r
    text = metrics_of(fleet.replicas[0].port)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    # declared families: lora_requests_info has no sample until a request named an adapter
    names |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    read = {VLLM.running, VLLM.waiting, VLLM.kv[0], VLLM.cache_info, VLLM.lora_info, *VLLM.counters,
            *(m for m, _, _ in VLLM.by_label)}
    # an offloading connector's families only with one (which this CPU build cannot run)
    assert read - VLLM.optional <= names, f"vLLM 0.32 does not export {sorted(read - VLLM.optional - names)}"
    r = parse_metrics(text, VLLM)
    assert r.ok, r.error
    cfg = dict(series(text, "vllm:cache_config_info")[0][0])
    assert r.sample.engine_block == int(cfg["block_size"]) == 128  # vLLM's CPU attention: 128-token blocks
    assert r.sample.cache_tokens == int(cfg["kv_cache_size_tokens"]) and r.sample.prefix_caching is True


def _conversation(fleet, rng: random.Random, sessions: int, turns: int) -> list[dict]:
    """Sessions over two projects' ~1,900-token system prompts, taking turns one request at a time; each result
    pairs the engine's usage with the brain's decision for the same request (by Envoy's x-request-id)."""
    texts = system_texts(2, [1500, 1500], seed=rng.randrange(1 << 30))
    convs = [[{"role": "system", "content": texts[i % 2]}] for i in range(sessions)]
    out = []
    for t in range(turns):
        for i, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": f"s{i}-t{t} " + "context line of code and tool output. "
                         * rng.randint(8, 40)})
            status, headers, doc = post(fleet.url, "/v1/chat/completions",
                                        {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0},
                                        {"x-session-id": f"conv-{i}"})
            assert status == 200, doc
            msgs.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
            rid = headers.get("x-request-id") or headers.get("X-Request-Id")
            d = json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]
            out.append({"decision": d, "usage": doc["usage"]})
    return out


def test_predicted_cached_tokens_are_what_the_engine_reports(fleet):
    """Within one engine block (or 5% of the prompt) for at least 90% of a multi-turn workload's requests: the
    brain counts in the engine's tokens (learned from its prompt_tokens) and its whole 128-token blocks."""
    got = _conversation(fleet, random.Random(5), sessions=6, turns=5)
    rows = []
    for g in got:
        d, u = g["decision"], g["usage"]
        true, pred, prompt = u["prompt_tokens_details"]["cached_tokens"], d["predicted_cached_tokens"], u["prompt_tokens"]
        rows.append((pred, true, prompt, d["predicted_prompt_tokens"], abs(pred - true) <= max(128, 0.05 * prompt)))
    share = sum(r[-1] for r in rows) / len(rows)
    print(f"\npredicted cached tokens within a block of the engine's: {share:.0%} of {len(rows)} requests")
    for pred, true, prompt, pprompt, ok in rows:
        print(f"  predicted {pred:5d} cached of {pprompt:5d} | engine {true:5d} cached of {prompt:5d} "
              f"{'' if ok else 'MISS'}")
    assert share >= 0.9, rows
    # the scale the brain learned is the engine's tokens per estimated token: prompts agree too
    assert sum(abs(r[3] - r[2]) <= 0.1 * r[2] for r in rows[-12:]) >= 10, rows[-12:]


def _resident_blocks(fleet, name: str) -> int:
    [r] = [r for r in fleet.state()["replicas"] if r["name"] == name]
    return sum(e["resident_blocks"] for e in r["cache"]["engines"] or ())


def test_exact_mode_predicts_the_engine_s_cached_and_prompt_tokens_and_a_foreign_seed_is_estimated(fleet):
    """Issue 45: on the replica whose KV events verify, the brain's predicted cached tokens and prompt tokens are the
    engine's own for every request (a chat workload of growing conversations); the replica whose engine hashes
    with another seed says so in /state and serves as before."""
    # the conversations' two system prompts, computed on r0's engine first (not through the brain): r0's events say it
    # holds them, so the cost model places the sessions there. Left to a tie, where a new session went hung on the
    # round-robin that the module's earlier tests left, and on one machine every session went to r1 (none to check)
    texts = system_texts(2, [1500, 1500], seed=random.Random(11).randrange(1 << 30))
    before = _resident_blocks(fleet, "r0")
    for text in texts:
        status, _, doc = post(f"http://127.0.0.1:{fleet.replicas[0].port}", "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "system", "content": text}], "max_tokens": 1})
        assert status == 200, doc
    wait_for(lambda: _resident_blocks(fleet, "r0") >= before + 2 * 10, 30, "r0's events for the system prompts")
    got = _conversation(fleet, random.Random(11), sessions=6, turns=4)
    by = {r["name"]: r for r in fleet.state()["replicas"]}
    assert by["r0"]["cache"]["mode"] == "exact", by["r0"]["cache"]
    [eng] = by["r0"]["cache"]["engines"]
    assert eng["verified_blocks"] > 0 and eng["mismatched_blocks"] == 0 and eng["block_size"] == 128, eng
    assert by["r1"]["cache"]["mode"] == "estimated" and "mismatch" in by["r1"]["cache"]["reason"], by["r1"]["cache"]
    exact = [(g["decision"]["predicted_cached_tokens"], g["usage"]["prompt_tokens_details"]["cached_tokens"],
              g["decision"]["predicted_prompt_tokens"], g["usage"]["prompt_tokens"])
             for g in got if g["decision"]["replica"] == "r0"]
    print(f"\nexact mode on r0: {len(exact)} requests")
    for row in exact:
        print("  predicted %5d cached of %5d | engine %5d cached of %5d" % (row[0], row[2], row[1], row[3]))
    assert len(exact) >= 6, got
    assert all(p == e for p, e, _, _ in exact), exact
    assert all(pp == ep for _, _, pp, ep in exact), exact
    assert sum(e for _, e, _, _ in exact) > 0, "some turn hit the cache"
    # an adapter's conversation (tiny-lora-b: r0 alone serves it): its blocks carry its name and path (from r0's
    # /v1/models), and they are priced as exactly
    msgs: list[dict] = [{"role": "system", "content": "You review patches. " * 120}]
    rows = []
    for t in range(3):
        msgs.append({"role": "user", "content": f"patch {t}: " + "a changed line of code. " * 40})
        status, headers, doc = post(fleet.url, "/v1/chat/completions", {"model": "tiny-lora-b", "messages": msgs,
                                                                        "max_tokens": 8, "temperature": 0},
                                    {"x-session-id": "adapter-b"})
        assert status == 200, _error_code(json.dumps(doc).encode())
        msgs.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"] or "ok"})
        rid = headers.get("x-request-id") or headers.get("X-Request-Id")
        d = json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]
        rows.append((d["predicted_cached_tokens"], doc["usage"]["prompt_tokens_details"]["cached_tokens"],
                     d["predicted_prompt_tokens"], doc["usage"]["prompt_tokens"]))
    print(f"adapter tiny-lora-b on r0: {rows}")
    assert all(p == e and pp == ep for p, e, pp, ep in rows) and rows[-1][1] > 0, rows
    assert fleet.replica_state("r0")["cache"]["engines"][0]["unverifiable_blocks"] == 0


def _reload(fleet, exact_enabled: bool, r0: dict) -> None:
    fleet.overrides = {**fleet.overrides, "exact_cache": {**fleet.overrides["exact_cache"], "enabled": exact_enabled}}
    fleet.replica_config = {**fleet.replica_config, "r0": r0}
    fleet.write_config()
    fleet.admin_post("/reload")


def test_exact_mode_through_publishers_named_in_the_config_as_on_a_vllm_without_kv_event_sources(fleet):
    """Issue 63: an engine whose KV event publishers the operator names (``replicas[].kv_events``, as a vLLM before
    0.32 needs: it has no GET /kv_event_sources) is priced as exactly as one whose publishers were listed: the
    brain's predicted cached and prompt tokens are the engine's own on every request there."""
    port = fleet.replicas[0].port
    src = json.loads(http_get(f"http://127.0.0.1:{port}/kv_event_sources"))["0"]  # what the operator passed vLLM
    named = {"kv_events": {"endpoint": src["endpoint"], "replay_endpoint": src["replay_endpoint"]}}
    cache = lambda: fleet.replica_state("r0")["cache"]  # noqa: E731
    try:
        _reload(fleet, False, {})  # the readers the listing started are stopped
        wait_for(lambda: cache()["events_from"] is None, 30, "r0's readers stopped")
        _reload(fleet, True, named)
        rng = random.Random(17)
        wait_for(lambda: asyncio.run(_burst(fleet.url, 2, 2, rng)) and cache()["mode"] == "exact", 60,
                 "r0 exact from its configured publisher", every=0.5)
        assert cache()["events_from"] == "configured"
        # the conversation on r0 alone: which replica the cost model prefers is not what this test is about (a run
        # where r1 had learned a faster rate sent all 24 turns there)
        fleet.admin_post("/replicas/r1/drain")
        got = _conversation(fleet, random.Random(19), sessions=6, turns=4)
        exact = [(g["decision"]["predicted_cached_tokens"], g["usage"]["prompt_tokens_details"]["cached_tokens"],
                  g["decision"]["predicted_prompt_tokens"], g["usage"]["prompt_tokens"])
                 for g in got if g["decision"]["replica"] == "r0"]
        print(f"\nexact mode on r0 through its configured publisher: {len(exact)} requests {exact}")
        assert len(exact) >= 6, got
        assert all(p == e and pp == ep for p, e, pp, ep in exact), exact
        assert sum(e for _, e, _, _ in exact) > 0, "some turn hit the cache"
    finally:
        fleet.admin_post("/replicas/r1/undrain")
        _reload(fleet, True, {})
    wait_for(lambda: cache()["events_from"] == "listed", 30, "r0 asked at /kv_event_sources again")


def test_turns_under_way_decided_at_their_headers_reach_their_home_whole_and_find_their_context(fleet):
    """Issue 61 on real engines: a session's turns that name their model in a header are routed at their headers and
    their bodies streamed unread; the engine answers each from the context its home holds (its own cached_tokens),
    and a turn that changes model mid-session reads its body and goes to that model's replica."""
    msgs: list[dict] = [{"role": "system", "content": "You maintain the billing service. " * 60}]
    rows = []
    for t in range(4):
        msgs.append({"role": "user", "content": f"step {t}: " + "explain the failing check in detail. " * 10})
        status, headers, doc = post(fleet.url, "/v1/chat/completions",
                                    {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0},
                                    {"x-session-id": "header-path", "x-model": MODEL})
        assert status == 200, doc
        msgs.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"] or "ok"})
        rid = headers.get("x-request-id") or headers.get("X-Request-Id")
        d = json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]
        rows.append((d["path"], d["replica"], doc["usage"]["prompt_tokens"],
                     doc["usage"]["prompt_tokens_details"]["cached_tokens"]))
    print(f"\nheader path on real engines (path, replica, prompt, engine cached): {rows}")
    assert rows[0][0] == "body" and all(r[0] == "headers" for r in rows[1:]), rows
    assert len({r[1] for r in rows}) == 1, rows  # every turn on its home
    # the engine read each whole body (its prompt grew turn by turn) and found the session's context there
    assert all(b[2] > a[2] for a, b in zip(rows, rows[1:])), rows
    assert all(r[3] >= rows[i][2] - 128 - 16 for i, r in enumerate(rows[1:])), rows
    msgs.append({"role": "user", "content": "now in the other model"})
    status, headers, doc = post(fleet.url, "/v1/chat/completions",
                                {"model": "tiny-coder", "messages": msgs, "max_tokens": 4, "temperature": 0},
                                {"x-session-id": "header-path", "x-model": "tiny-coder"})
    assert status == 200, doc
    rid = headers.get("x-request-id") or headers.get("X-Request-Id")
    d = json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]
    assert d["path"] == "body" and d["replica"] == "r2", d


READ = {"name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _agent_turn(api: str, system: str, turns: list[tuple[str, str, str]], k: int) -> tuple[str, dict]:
    """One agent conversation so far in ``api``'s own shape: a system prompt, tools, and per past turn a user
    message, a tool call with its result and the assistant's answer; then this turn's question."""
    ask = lambda t: f"step {t}: " + "fix the failing test in the parser module. " * (6 + 3 * t)  # noqa: E731
    if api == "chat":
        msgs: list[dict] = [{"role": "system", "content": system}]
        for t, (out, call, answer) in enumerate(turns):
            msgs += [{"role": "user", "content": ask(t)},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": call, "type": "function",
                                                                            "function": {
                         "name": "read_file", "arguments": json.dumps({"path": f"src/m{t}.py"})}}]},
                     {"role": "tool", "tool_call_id": call, "content": out}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": ask(k)})
        return "/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function", "function": READ}],
                                        "max_tokens": 16}
    if api == "messages":
        msgs = []
        for t, (out, call, answer) in enumerate(turns):
            msgs += [{"role": "user", "content": ask(t)},
                     {"role": "assistant", "content": [{"type": "text", "text": "reading"}, {
                         "type": "tool_use", "id": call, "name": "read_file", "input": {"path": f"src/m{t}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": out}]},
                     {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        msgs.append({"role": "user", "content": [{"type": "text", "text": ask(k)}]})
        return "/v1/messages", {"system": [{"type": "text", "text": system}], "messages": msgs, "max_tokens": 16,
                                "tools": [{"name": READ["name"], "description": READ["description"],
                                           "input_schema": READ["parameters"]}]}
    items: list[dict] = []
    for t, (out, call, answer) in enumerate(turns):
        items += [{"role": "user", "content": ask(t)},
                  {"type": "function_call", "call_id": call, "name": "read_file",
                   "arguments": json.dumps({"path": f"src/m{t}.py"})},
                  {"type": "function_call_output", "call_id": call, "output": out},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}]
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask(k)}]})
    return "/v1/responses", {"instructions": system, "input": items, "tools": [{"type": "function", **READ}],
                             "store": False, "max_output_tokens": 16}


def _engine_usage(doc: dict) -> tuple[int, int]:
    """(cached, prompt) tokens in the engine's answer, whichever API's usage it is."""
    u = doc["usage"]
    if "prompt_tokens" in u:
        return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]
    if "input_tokens_details" in u:
        return u["input_tokens_details"]["cached_tokens"], u["input_tokens"]
    read = u.get("cache_read_input_tokens") or 0
    return read, u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0)


def _answer_text(doc: dict) -> str:
    if "choices" in doc:
        return doc["choices"][0]["message"]["content"] or "ok"
    if doc.get("type") == "message":
        return next((b["text"] for b in doc["content"] if b["type"] == "text"), "") or "ok"
    return next((c["text"] for o in doc["output"] if o["type"] == "message" for c in o["content"]), "") or "ok"


def test_exact_mode_holds_for_agents_speaking_chat_messages_and_responses_with_tools(fleet):
    """Issue 45: sessions of a coding agent in each of the three APIs (tool calls and their results in every turn,
    a system prompt two projects share): on the exact replica the brain's prompt and cached tokens are the
    engine's own for every request, whichever API carried it."""
    rng = random.Random(17)
    texts = system_texts(2, [1200, 1200], seed=rng.randrange(1 << 30))
    # five sessions an API: where a new session goes depends on the fleet's load (under make test's load 2 of 9
    # sessions once landed on the exact replica, both of one API); each API needs some there
    sessions = [(api, texts[i % 2], []) for i, api in enumerate(["chat", "messages", "responses"] * 5)]
    rows = []
    # every session on the exact replica: where the cost model sends new sessions is not what this test is about (a
    # run where r1 read cheaper took every responses session)
    fleet.admin_post("/replicas/r1/drain")
    try:
        _agent_sessions(fleet, sessions, rng, rows)
    finally:
        fleet.admin_post("/replicas/r1/undrain")
    print(f"\nexact mode on r0, three APIs with tools: {len(rows)} requests")
    for row in rows:
        print("  %-9s predicted %5d cached of %5d | engine %5d cached of %5d" % row)
    assert {r[0] for r in rows} == {"chat", "messages", "responses"}, rows
    assert all(pc == ec and pp == ep for _, pc, pp, ec, ep in rows), rows
    assert sum(r[3] for r in rows) > 0, "some turn hit the cache"


def _agent_sessions(fleet, sessions, rng, rows) -> None:
    for k in range(4):
        for i, (api, system, turns) in enumerate(sessions):
            path, body = _agent_turn(api, system, turns, k)
            status, headers, doc = post(fleet.url, path, {"model": MODEL, "temperature": 0, **body},
                                        {"x-session-id": f"agent-{i}"})
            assert status == 200, (api, status)
            rid = headers.get("x-request-id") or headers.get("X-Request-Id")
            d = json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]
            # tool output of three token scales: words, code-like lines, hex digests
            line = [lambda: f"line {rng.randrange(10**6)}",
                    lambda: f"def f_{rng.randrange(999)}(x): return x * {rng.randrange(99)}",
                    lambda: f"{rng.getrandbits(128):032x}"][(i + k) % 3]
            turns.append(("\n".join(line() for _ in range(rng.randint(10, 40))), f"call_{i}_{k}", _answer_text(doc)))
            if d["replica"] == "r0":
                rows.append((api, d["predicted_cached_tokens"], d["predicted_prompt_tokens"], *_engine_usage(doc)))


def test_a_prefix_cache_reset_through_the_brain_is_the_brain_s_view_at_once(fleet):
    """POST /replicas/r0/reset_prefix_cache on the brain's admin API: the engine empties its cache and the brain's
    view of it is empty as the call returns (an idle engine publishes its AllBlocksCleared only at its next step,
    after the next request was priced); the engine's next events keep it exact."""
    engine = f"http://127.0.0.1:{fleet.replicas[0].port}"
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "reset me " * 300}]}
    cache = lambda: fleet.replica_state("r0")["cache"]  # noqa: E731
    assert post(engine, "/v1/chat/completions", body)[0] == 200  # straight to r0's engine: it holds this prompt
    wait_for(lambda: cache()["engines"][0]["resident_blocks"] > 0, 30, "r0's events in")
    quiet(fleet, 30)  # vLLM refuses to reset while requests hold blocks
    doc = json.loads(fleet.admin_post("/replicas/r0/reset_prefix_cache"))
    assert doc["reset"] is True, doc
    assert cache()["engines"][0]["resident_blocks"] == 0 and cache()["mode"] == "exact", cache()
    _, _, again = post(engine, "/v1/chat/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine's own word: it was emptied
    wait_for(lambda: cache()["engines"][0]["resident_blocks"] > 0, 30, "r0's events after the reset")
    assert cache()["mode"] == "exact", cache()


def _error_code(body: bytes) -> str:
    """An error answer's code or type alone: what the test prints of it (an engine's error message may quote the
    prompt, and no prompt text is ever printed or logged)."""
    try:
        err = json.loads(body).get("error") or {}
        return str(err.get("code") or err.get("type") or "no code") if isinstance(err, dict) else "no code"
    except (ValueError, AttributeError):
        return "not JSON"


async def _burst(url: str, n: int, concurrency: int, rng: random.Random, model: str = MODEL,
                 max_tokens: int = 48, stop: Callable[[], bool] = lambda: False,
                 words: tuple[int, int] = (150, 600), details: list | None = None) -> list[int]:
    """``n`` new conversations (nothing cached), ``concurrency`` at a time, streamed; their statuses (0: cut short).
    Once ``stop()`` is true, no further conversation starts. ``details`` gets each one's (status, Envoy's request id
    when an answer began, what cut it short)."""
    sem = asyncio.Semaphore(concurrency)
    statuses: list[int] = []

    async def one(http: aiohttp.ClientSession, k: int) -> None:
        text = " ".join(f"w{rng.randrange(100_000)}" for _ in range(rng.randint(*words)))
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"burst {k}: {text}"}]}
        async with sem:
            if stop():
                return
            try:
                async with http.post(url + "/v1/chat/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=120)) as r:
                    rid = r.headers.get("x-request-id")
                    head = b""
                    try:
                        async for chunk in r.content:
                            if r.status != 200 and len(head) < 4096:
                                head += chunk
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        statuses.append(0)
                        if details is not None:
                            details.append((r.status, rid, type(e).__name__))
                        return
                    statuses.append(r.status)
                    if details is not None:
                        details.append((r.status, rid, None if r.status == 200 else _error_code(head)))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                statuses.append(0)
                if details is not None:
                    details.append((0, None, type(e).__name__))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(http, k) for k in range(n)))
    return statuses


def _engine_rates(text: str) -> tuple[float, float, float, float]:
    """(computed prefill tokens, prefill seconds, decoded tokens, decode seconds) from the engine's own histograms."""
    done = total(text, "vllm:request_decode_time_seconds_count")
    return (total(text, "vllm:request_prefill_kv_computed_tokens_sum"), total(text,
                                                                              "vllm:request_prefill_time_seconds_sum"),
            total(text, "vllm:request_generation_tokens_sum") - done,  # each request's first token is prefill's
            total(text, "vllm:request_decode_time_seconds_sum"))


BURST_CONCURRENCY = 4


def test_learned_rates_move_to_the_engines_own_histograms(fleet):
    """Under a burst of new conversations the brain's prefill and decode rates leave their priors for the means of
    the engine's own request_prefill_time_seconds and request_decode_time_seconds: closer to those than the priors
    are. (How close through a ramp on a quiet machine is a benchmark's number, not a test's.)"""
    w = fleet.cfg.router.warm
    before = {r.name: _engine_rates(metrics_of(r.port)) for r in fleet.replicas[:2]}
    # a prefill sample needs 5 s of the engine's prefill and a decode sample 500 generated tokens (core.load): the
    # burst goes on until each engine's own counters show three of each (~60K tokens a replica on a CPU with AVX-512,
    # ~6K without), at most 32 conversations. Long prompts, so that the burst alone gives it whatever ran before.
    # Decode samples are waited for only where the decode assertion below runs: an engine decoding near the prior
    # (vLLM's CPU backend without AVX-512) would take 32 conversations (~110 s) for decode samples nothing checks
    enough = threading.Event()
    near_prior: set[str] = set()  # replicas whose burst stopped before their decode samples: not asserted below

    def decode_done(g: tuple[float, ...]) -> bool:
        return g[2] >= 3 * 500 or (g[2] >= 100 and 0.6 < g[3] / g[2] / w.decode_s_per_token < 1.6)

    def watch() -> None:
        while not enough.wait(0.5):
            grown = {r.name: tuple(b - a for a, b in zip(before[r.name], _engine_rates(metrics_of(r.port))))
                     for r in fleet.replicas[:2]}
            if all(g[1] >= 3 * 5.0 and decode_done(g) for g in grown.values()):
                near_prior.update(name for name, g in grown.items() if g[2] < 3 * 500)
                enough.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert all(s == 200 for s in asyncio.run(_burst(fleet.url, 32, BURST_CONCURRENCY, random.Random(3),
                                                        words=(1500, 2400), stop=enough.is_set)))
    finally:
        enough.set()
        watcher.join(10)
    quiet(fleet, 30)
    for rep in fleet.replicas[:2]:
        c0, p0, g0, d0 = before[rep.name]
        c1, p1, g1, d1 = _engine_rates(metrics_of(rep.port))
        prefill, dec = (c1 - c0) / (p1 - p0), (d1 - d0) / (g1 - g0)
        learned = fleet.replica_state(rep.name)["learned"]
        print(f"\n{rep.name}: prefill {learned['prefill_tokens_per_second']:.0f} tok/s learned vs {prefill:.0f} "
              f"engine (prior {w.prefill_tokens_per_s:.0f}); decode {learned['decode_seconds_per_token'] * 1000:.2f} "
              f"ms/token learned vs {dec * 1000:.2f} engine (prior {w.decode_s_per_token * 1000:.0f}); "
              f"scale {learned['engine_tokens_per_estimated_token']:.3f}")
        # the brain learns a rate at no batch and a slowdown per request beside it (core.load); the burst ran 0 to
        # BURST_CONCURRENCY others beside each request, so the learned rates over those batches are what it predicts
        # of this burst: the engine's mean lies among them, or nearer to them than to the prior
        k_p, k_d = learned.get("prefill_slowdown_per_running_request", 0.0), \
            learned.get("decode_slowdown_per_running_request", 0.0)
        r0 = learned["prefill_tokens_per_second"]
        d0 = learned["decode_seconds_per_token"]
        prefill_band = (r0 / (1 + k_p * BURST_CONCURRENCY), r0)
        decode_band = (d0, d0 * (1 + k_d * BURST_CONCURRENCY))
        assert _off(prefill, prefill_band) < abs(w.prefill_tokens_per_s - prefill), (prefill_band, prefill)
        # the decode prior (0.2 s) is distant from an engine decoding in 2.5-4 ms, not from one in 70-320 ms (vLLM's
        # CPU backend without AVX-512, 2026-12-06: 163 ms): "nearer than the prior" tells nothing apart there
        if rep.name not in near_prior and not 0.5 < dec / w.decode_s_per_token < 2.0:
            assert _off(dec, decode_band) < abs(w.decode_s_per_token - dec), (decode_band, dec)


def _off(x: float, band: tuple[float, float]) -> float:
    """How far ``x`` lies outside ``band`` (0: inside)."""
    return max(0.0, band[0] - x, x - band[1])


def _served(fleet, model: str, n: int = 6) -> set[str]:
    """The replicas that served ``n`` new conversations for ``model`` (by the cluster Envoy logged as chosen)."""
    names = set()
    for k in range(n):
        status, headers, doc = post(fleet.url, "/v1/completions",
                                    {"model": model, "prompt": f"served {model} {k} {time.monotonic()}",
                                     "max_tokens": 2})
        assert status == 200, doc
        rid = headers.get("x-request-id") or headers.get("X-Request-Id")
        names.add(json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]["replica"])
    return names


def test_models_and_adapters_static_and_loaded_at_run_time_are_followed(fleet):
    r1 = fleet.replicas[1]
    listed = {m["id"] for m in json.loads(http_get(fleet.url + "/v1/models"))["data"]}
    assert listed == {"tiny-llama", "tiny-coder", "tiny-lora-a", "tiny-lora-b"}
    assert _served(fleet, "tiny-coder") == {"r2"}  # another --served-model-name: its own replica only
    assert _served(fleet, "tiny-lora-b") == {"r0"}  # the one adapter only r0 loaded at start
    assert _served(fleet, "tiny-lora-a", 4) <= {"r0", "r1"}  # both serve it (which: the adapter slots' cost)
    # an adapter loaded at run time is followed from /v1/models, and routed there; unloaded, it is gone
    adapter = real_vllm.model_dir() / "adapters" / "tiny-lora-b"
    status, _, doc = post(r1.url, "/v1/load_lora_adapter", {"lora_name": "tiny-lora-new", "lora_path": str(adapter)})
    assert status == 200, doc
    wait_for(lambda: "tiny-lora-new" in fleet.replica_state("r1")["models"], 20, "the brain to see r1's new adapter")
    assert _served(fleet, "tiny-lora-new", 3) == {"r1"}
    status, _, doc = post(r1.url, "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-new"})
    assert status == 200, doc
    wait_for(lambda: "tiny-lora-new" not in fleet.replica_state("r1")["models"], 20, "the brain to see it unloaded")
    status, _, doc = post(fleet.url, "/v1/completions", {"model": "tiny-lora-new", "prompt": "x", "max_tokens": 2})
    assert status == 404 and doc["error"]["type"] == "NotFoundError"


def test_lora_requests_info_is_read_at_its_newest_label_set(fleet):
    """vLLM 0.32 keeps every label set lora_requests_info ever had (its value: when it was set): an adapter that
    ran once stays listed in an older set. After its requests end the newest set is empty, and so is the read."""
    r0 = fleet.replicas[0]
    status, _, doc = post(fleet.url, "/v1/completions", {"model": "tiny-lora-b", "prompt": "lora", "max_tokens": 8})
    assert status == 200, doc
    quiet(fleet, 30)
    text = metrics_of(r0.port)
    sets = series(text, "vllm:lora_requests_info")
    assert len(sets) >= 2, [line for line in text.splitlines() if "lora" in line]
    assert any("tiny-lora-b" in lab.get("running_lora_adapters", "") for lab, _ in sets), sets  # an older one
    assert max(sets, key=lambda s: s[1])[0]["running_lora_adapters"] == "", sets
    r = parse_metrics(text, VLLM)
    assert r.ok and r.sample.lora_running == frozenset() and r.sample.max_lora == 2


def test_an_unknown_model_gets_from_the_brain_what_vllm_itself_answers(fleet):
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, ours = post(fleet.url, "/v1/chat/completions", body)
    status_v, _, theirs = post(fleet.replicas[2].url, "/v1/chat/completions", body)
    assert status == status_v == 404
    assert set(ours) == set(theirs) == {"error"} and set(ours["error"]) == set(theirs["error"])
    for field in ("type", "param", "code"):
        assert ours["error"][field] == theirs["error"][field], field
    # the same sentence; a fleet's valid names are every model its replicas serve, one replica's its own
    assert theirs["error"]["message"] == "The model `no-such-model` does not exist. Valid aliases: tiny-coder."
    assert ours["error"]["message"] == "The model `no-such-model` does not exist. Valid aliases: tiny-coder, tiny-llama."


def test_the_agents_sdks_converse_through_warmroute_with_real_engines(fleet):
    """Claude Code's API and the stored Responses API, spoken by their own SDKs: a Messages conversation keeps its
    prefix on one engine; every Responses follow-up, retrieval and cancel reaches the engine whose memory holds its
    response, the holder drained for new work too; errors on /v1/messages come in Anthropic's shape as vLLM's."""
    import anthropic
    import openai

    from extproc.core.apis import parse_minted, replica_tag

    system = "You are a coding agent. Keep the repository's style and run its tests. " * 30
    a = anthropic.Anthropic(api_key="unused", base_url=fleet.url, max_retries=0, timeout=120)
    history: list[dict] = []
    prompt = 0  # the last turn's prompt tokens, as the engine counted them
    for turn in range(3):
        history.append({"role": "user", "content": [{"type": "text", "text": f"step {turn}: fix the parser " * 20}]})
        kw = dict(model=MODEL, max_tokens=8, system=system, messages=history,
                  metadata={"user_id": "user_1_account_1_session_real"})
        if turn == 1:
            with a.messages.stream(**kw) as st:
                msg = st.get_final_message()
        else:
            msg = a.messages.create(**kw)
        if turn:
            # whole 128-token blocks; on failure, where the brain put each turn so far and why (the module's tests
            # run one at a time: the last decisions are this conversation's; Envoy replaces a client's request id)
            assert msg.usage.cache_read_input_tokens >= 0.8 * prompt - 128, (
                msg.usage, json.loads(fleet.admin_get(f"/decisions?last={turn + 1}"))["decisions"])
        # Anthropic's (and vLLM's) prompt: input + cache read + cache creation
        prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) + \
            (msg.usage.cache_creation_input_tokens or 0)
        history.append({"role": "assistant", "content": [{"type": "text", "text": msg.content[0].text or "ok"}]})
    # count_tokens: the engine's own count of the same conversation, through the brain
    counted = a.messages.count_tokens(model=MODEL, system=system, messages=history[:-1]).input_tokens
    assert abs(counted - prompt) <= 8, (counted, prompt)  # the last turn's messages: its prompt, template aside
    bad = {"model": "no-such-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    (s1, _, ours), (s2, _, theirs) = post(fleet.url, "/v1/messages", bad), post(fleet.replicas[0].url, "/v1/messages",
                                                                                bad)
    assert s1 == s2 == 404 and set(ours) == set(theirs) == {"type", "error"}
    assert set(ours["error"]) == set(theirs["error"]) and ours["error"]["type"] == theirs["error"]["type"]

    o = openai.OpenAI(api_key="unused", base_url=fleet.url + "/v1", max_retries=0, timeout=120)
    names = {replica_tag(r.name): r.name for r in fleet.replicas}
    first = o.responses.create(model=MODEL, instructions=system, input="start " * 40, max_output_tokens=8)
    home = names[parse_minted(first.id)[0]]
    fleet.admin_post(f"/replicas/{home}/drain")
    try:
        prev = first
        for turn in range(3):
            kw = dict(model=MODEL, instructions=system, input=f"turn {turn} " * 20, previous_response_id=prev.id,
                      max_output_tokens=8)
            if turn == 1:
                nxt = [e for e in o.responses.create(stream=True, **kw) if e.type == "response.completed"][0].response
            else:
                nxt = o.responses.create(**kw)
            assert names[parse_minted(nxt.id)[0]] == home
            assert nxt.usage.input_tokens_details.cached_tokens >= 0.8 * prev.usage.input_tokens - 128
            prev = nxt
        got = o.responses.retrieve(first.id)  # "incomplete": 8 tokens were all it could write
        assert (got.id, got.status) == (first.id, first.status)
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
            o.responses.cancel(prev.id)  # the holder's own answer; any other engine: not found
        # a background response, polled with its replica drained too
        bg = o.responses.create(model=MODEL, input="in the background " * 20, max_output_tokens=8, background=True)
        bg_home = names[parse_minted(bg.id)[0]]
        fleet.admin_post(f"/replicas/{bg_home}/drain")
        wait_for(lambda: o.responses.retrieve(bg.id).status not in ("queued", "in_progress"), 60, "background")
    finally:
        for name in {home, locals().get("bg_home", home)}:
            fleet.admin_post(f"/replicas/{name}/undrain")


def test_the_real_servers_openapi_is_the_path_catalog(fleet):
    r0 = fleet.replicas[0]
    doc = json.loads(http_get(r0.url + "/openapi.json", 5))
    assert sorted(doc["paths"]) == fleet.replica_state("r0")["paths"]
    assert "/v1/messages" in doc["paths"] and "/v1/audio/transcriptions" not in doc["paths"]
    status, _, body = post(fleet.url, "/v1/audio/transcriptions", {"model": MODEL})
    assert status == 404 and body["error"]["type"] == "NotFoundError"


def test_vllm_bench_serve_through_warmroute_fails_nothing(fleet, tmp_path):
    """vLLM's own load generator, a client we did not write, on the real fleet: every request completes."""
    from bench.runs.serve import vllm_bench_serve

    r = vllm_bench_serve(fleet.url, MODEL, tmp_path, prompts=16, concurrency=4, prefix_len=512, output_len=16)
    print(f"\nvllm bench serve: {r['completed']} completed, {r['failed']} failed, TTFT p50 {r['median_ttft_ms']:.0f} ms")
    assert (r["completed"], r["failed"]) == (16, 0)


def test_the_engine_the_brain_names_is_the_one_whose_counters_move(fleet):
    s = fleet
    port = s.replicas[2].port
    assert [e["rank"] for e in s.replica_state("r2")["engines"]] == [0, 1]
    named = []
    unnamed = 0
    for k in range(8):
        before = metrics_of(port)
        status, headers, doc = post(s.url, "/v1/completions", {"model": "tiny-coder", "prompt": f"dp {k} " * 50,
                                                               "max_tokens": 2})
        assert status == 200, doc
        rid = headers.get("x-request-id") or headers.get("X-Request-Id")
        engine = json.loads(s.admin_get(f"/decisions?request_id={rid}"))["decisions"][-1]["engine"]
        done_before = total(before, "vllm:request_success_total")

        def moved_on() -> str | None:
            t = metrics_of(port)
            return t if total(t, "vllm:request_success_total") > done_before else None

        after = wait_for(moved_on, 10, "the counters")
        moved = [e for e in (0, 1) if total(after, "vllm:request_success_total", engine=str(e))
                 > total(before, "vllm:request_success_total", engine=str(e))]
        if engine is None:
            # the brain named no engine and left the choice to the replica's front end: seen once in a CI run
            # with the machine saturated (make test's second phase); counted, and bounded below
            unnamed += 1
            continue
        assert moved == [engine], (k, engine, moved)
        named.append(engine)
    assert unnamed <= 2, f"{unnamed} of 8 requests were not steered"
    assert set(named) == {0, 1}  # both engines were chosen: the header steered, not a default


def test_a_vllm_without_log_stats_gives_the_documented_scrape_reason(fleet):
    r = parse_metrics(metrics_of(fleet.replicas[3].port), VLLM)
    assert not r.ok and r.missing
    assert "--disable-log-stats" in r.error and "engine: none (or auto)" in r.error
    st = fleet.replica_state("r3")
    assert st["state"] == "EJECTED" and st["scrape_error"] == r.error


def test_a_replica_killed_mid_load_is_ejected_costs_only_its_streams_and_earns_its_way_back(fleet):
    """SIGKILL on a replica's engine (r0's when it holds a stream) while four streams run on tiny-llama: only requests
    that were on it fail; the rest and every later one succeed; it is ejected and, restarted on its port, comes back
    LIVE through its scrapes."""
    quiet(fleet, 30)
    results: list[int] = []
    victim: list[str] = []
    details: list[tuple] = []
    serving = ("r0", "r1")  # tiny-llama's replicas (r2 serves tiny-coder; r3 is ejected: no stats)

    def holding() -> str | None:
        # r0 when it holds a stream (its adapter is checked at the end); else r1: twice in CI the brain sent r0
        # nothing for 90 s of a 4-stream load beside the no-process tests (learned rates there favour r1)
        states = {n: fleet.replica_state(n)["in_flight_requests"] for n in serving}
        return next((n for n in serving if states[n] > 0), None)

    async def load_and_kill() -> None:
        # the load goes on until a replica holds a stream, then 8 more conversations start after the kill
        started_after: list[int] = []

        def enough() -> bool:
            if started_after:
                started_after[0] += 1
                return started_after[0] > 8
            return False

        task = asyncio.ensure_future(_burst(fleet.url, 200, 4, random.Random(11), max_tokens=64, stop=enough,
                                            details=details))
        name = await asyncio.to_thread(wait_for, holding, 90, "a stream on a replica")
        victim.append(name)
        in_flight = fleet.replica_state(name)["in_flight_requests"]
        fleet.kill_replica(name)
        started_after.append(0)
        # streams the brain sent there between that reading and the kill died with it too: read again at once,
        # before the failed streams' access-log entries release them
        in_flight = max(in_flight, fleet.replica_state(name)["in_flight_requests"])
        results.extend(await task)
        results.append(-in_flight)

    asyncio.run(load_and_kill())
    name = victim[0]
    in_flight = -results.pop()
    failed = sum(s != 200 for s in results)
    # each failure by where its answer began: a stream on the killed replica (its own: lost with it), a stream
    # elsewhere (the fleet's: never), or no answer at all (Envoy neither got one nor retried elsewhere)
    own, elsewhere, unanswered = [], [], []
    for status, rid, why in details:
        if status == 200 and why is None:
            continue
        decided = {x.get("replica") for x in json.loads(fleet.admin_get(f"/decisions?request_id={rid}"))["decisions"]
                   } if rid else set()
        (own if name in decided else elsewhere if decided else unanswered).append((status, why, sorted(decided)))
    print(f"\nkilled {name} with {in_flight} of its streams in flight: {failed} of {len(results)} requests failed: "
          f"{len(own)} of its streams, {elsewhere} elsewhere, {unanswered} unanswered")
    assert len(own) + len(elsewhere) + len(unanswered) == failed
    assert not elsewhere
    # at most one unanswered: twice in make test (real engines beside the no-process tests) one request more than
    # r0's streams failed: one dispatched to r0 while its front end was dying (vLLM's port outlives its engine by
    # 0.05-1.3 s), it seems, and not retried elsewhere. Open (closing notes of 2026-12-02); the bound keeps "a kill
    # costs its own streams, not the fleet's" while that window is understood
    assert len(unanswered) <= 1
    wait_for(lambda: fleet.replica_state(name)["state"] == "EJECTED", 20, f"{name} EJECTED")
    # its KV event stream went with it: that replica's cache view is forgotten, not kept as if still true (r1's
    # events never verified, another seed: it stays estimated for that reason, which outranks a lost stream)
    cache = lambda: fleet.replica_state(name)["cache"]  # noqa: E731
    why = "unreachable" if name == "r0" else "mismatch"
    wait_for(lambda: cache()["mode"] == "estimated" and why in cache()["reason"], 30, f"{name}'s events lost")
    print(f"{name}'s cache after the kill: {cache()['reason']}")
    assert asyncio.run(_burst(fleet.url, 6, 3, random.Random(12))) == [200] * 6
    fleet.restart_replica(name)
    wait_for(lambda: fleet.replica_state(name)["state"] == "LIVE", 60, f"{name} LIVE again")
    if name == "r0":
        assert "r0" in _served(fleet, "tiny-lora-b", 1)  # only r0 serves it: routed there again
        # the restarted engine's events verify again: exact once it stored a block (events come with its steps)
        rng = random.Random(13)
        fleet.admin_post("/replicas/r1/drain")  # the bursts on r0, whichever replica the cost model prefers now
        try:
            wait_for(lambda: asyncio.run(_burst(fleet.url, 2, 2, rng)) and cache()["mode"] == "exact", 60,
                     "r0 exact again", every=0.5)
        finally:
            fleet.admin_post("/replicas/r1/undrain")



def _reload_warm(fleet, **warm) -> None:
    fleet.overrides = {**fleet.overrides, "warm": {**fleet.overrides.get("warm", {}), **warm}}
    fleet.write_config()
    fleet.admin_post("/reload")


def _working_sets(fleet, names) -> dict[str, tuple[int, int]]:
    """Per replica, (the active sessions' context, the cache) as the brain counts them, in engine tokens."""
    return {r["name"]: (r["predicted"]["active_session_tokens"], r["predicted"]["cache_tokens"])
            for r in fleet.state()["replicas"] if r["name"] in names}


def test_a_new_session_waits_in_the_brain_while_active_sessions_fill_the_real_caches(fleet):
    """Flow control by KV on real engines (issue 34): long sessions are placed until tiny-llama's two caches hold
    their contexts (the brain's fit rule, in the engine's tokens); the next new session is held in the brain, not
    sent where the engine's LRU would evict an active session's context while it thinks. While it waits, every
    placed session's next turn finds its whole context in the engine's cache (the engine's cached_tokens, not the
    brain's belief), and once the sessions go quiet the held one is served. warm.active_session_s is changed by
    reloads so that "quiet" is the test's choice, not a race with the clock.

    The brain counts each prompt in the engine's own tokens (exact mode: the model's tokenizer and template), so
    nothing is learned first: sessions alternate between texts of two token scales (words like "w48213" and hex
    digests), one of which a learned scale would count wrong. Before issue 45 this test needed rounds of traffic
    for the brain to learn this text's scale (one replica's was 13% short, more than warm.kv_pressure's 5% margin:
    a fifth session got in beside four and the engine evicted the tails of five contexts; docs/routing.md, "Flow
    control on real engines")."""
    serving = ("r0", "r1")  # tiny-llama's replicas (r2 serves tiny-coder; r3 is ejected: no stats)
    quiet(fleet, 30)
    rng = random.Random(34)
    held_thread: list[threading.Thread] = []
    config = fleet.overrides
    texts = [lambda: f"w{rng.randrange(100_000)}", lambda: f"{rng.getrandbits(64):016x}"]
    try:
        # earlier tests' sessions leave the working sets, then nothing goes quiet until the test says so
        _reload_warm(fleet, active_session_s=0.5)
        wait_for(lambda: all(a == 0 for a, _ in _working_sets(fleet, serving).values()), 30, "empty working sets")
        share = fleet.state()["flow_control"]["returning_share"]
        print(f"\nthe share of new sessions that came back, learned from the module's earlier tests: {share}")
        if share < 1.0:
            # the module's earlier tests left one-turn sessions, and a first turn counts at the learned share of new
            # sessions that came back (routing.md, "Sessions that never come back"): at ~2/3 the brain lets in more
            # sessions than the caches hold, as designed for traffic that does not return. This test is about
            # sessions that do: a brain that has seen none yet expects them back (the share's prior)
            fleet.brain.stop()
            fleet.start_brain()
            wait_for(lambda: all(fleet.replica_state(n)["state"] == "LIVE" for n in serving), 60, "r0, r1 LIVE")
            assert fleet.state()["flow_control"]["returning_share"] == 1.0
        _reload_warm(fleet, active_session_s=3600.0)
        cache = min(c for _, c in _working_sets(fleet, serving).values())
        # each session's first turn a fifth of a cache, in the engine's own count: four fit beside each other
        # (within warm.kv_pressure), a fifth does not
        def first_turn(i: int) -> list[dict]:
            words = []
            while True:
                words += [texts[i % 2]() for _ in range(200 if i % 2 == 0 else 60)]
                msgs = [{"role": "user", "content": f"session {i}: " + " ".join(words)}]
                _, _, doc = post(f"http://127.0.0.1:{fleet.replicas[0].port}", "/tokenize",
                                 {"model": MODEL, "messages": msgs})
                if doc["count"] >= cache / 5:
                    return msgs

        sessions: list[tuple[list[dict], dict]] = []
        held = None
        for i in range(4 * len(serving) + 2):
            msgs = first_turn(i)
            out: dict = {}

            def send(msgs=msgs, out=out, i=i):
                out["answer"] = post(fleet.url, "/v1/chat/completions",
                                     {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0},
                                     {"x-session-id": f"fill-{i}"})
            t = threading.Thread(target=send)
            t.start()
            wait_for(lambda: "answer" in out or fleet.state()["flow_control"]["held"] > 0, 60,
                     f"session {i} answered or held")
            if "answer" not in out:
                held, held_out = i, out
                held_thread.append(t)
                break
            t.join()
            status, _, doc = out["answer"]
            assert status == 200, _error_code(json.dumps(doc).encode())
            sessions.append((msgs + [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]}],
                             doc["usage"]))
        sets = _working_sets(fleet, serving)
        print(f"\n{len(sessions)} sessions placed, session {held} held; working sets (context, cache): {sets}")
        assert held is not None, "no new session was held with every cache full of active sessions' contexts"
        # held only when the caches were full: the engine counted what the placed sessions hold
        placed = sum(u["prompt_tokens"] for _, u in sessions)
        assert placed >= len(serving) * 0.95 * cache - 2 * cache / 5, (placed, cache)
        # while it waits, each placed session's next turn keeps its whole context in its engine
        def belief() -> dict[str, tuple[float, float]]:
            return {r["name"]: (r["cached_tokens"]["predicted"], r["cached_tokens"]["engine"] or 0.0)
                    for r in fleet.state()["replicas"] if r["name"] in serving}

        before = belief()
        cached = []
        for k, (msgs, first) in enumerate(sessions):
            msgs.append({"role": "user", "content": f"and then {k}?"})
            status, _, doc = post(fleet.url, "/v1/chat/completions",
                                  {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0},
                                  {"x-session-id": f"fill-{k}"})
            assert status == 200, _error_code(json.dumps(doc).encode())
            cached.append((doc["usage"]["prompt_tokens_details"]["cached_tokens"], first["prompt_tokens"]))
        print(f"next turns' cached tokens against their first turns' prompt tokens (counts only): {cached}")
        assert all(c >= p - 128 for c, p in cached), cached  # all but the last, partial, 128-token block
        # and the brain's metrics say so: per replica, the engine's own hits (scraped) are what routing predicted
        def served() -> dict[str, tuple[float, float]]:
            now = belief()
            return {n: (now[n][0] - before[n][0], now[n][1] - before[n][1]) for n in serving}

        try:
            wait_for(lambda: all(e >= 0.97 * p > 0 for p, e in served().values()), 15,
                     "the engines' hits (scraped) at the brain's predicted cached tokens")
        finally:
            print(f"per replica, (predicted, engine) cached tokens over the next turns: {served()}")
        assert fleet.state()["flow_control"]["held"] == 1 and "answer" not in held_out
        # the sessions go quiet: their contexts may go, and the held session is served
        _reload_warm(fleet, active_session_s=0.5)
        held_thread[0].join(timeout=60)
        status, _, doc = held_out["answer"]
        assert status == 200, _error_code(json.dumps(doc).encode())
    finally:
        fleet.overrides = config
        fleet.write_config()
        fleet.admin_post("/reload")
        for t in held_thread:
            t.join(timeout=60)


def test_the_offload_events_fixture_is_what_vllm_s_own_classes_encode(tmp_path):
    """tests/fixtures/vllm-0.32/kv-events-offload.bin (an offloading connector's KV events, which this CPU build of
    vLLM cannot produce by running: its CPU offloading needs CUDA) is rebuilt from the engine venv's own event
    classes, block hash and encoder, byte for byte."""
    import subprocess

    from extproc.tools.stack.real_vllm import REPO, engine_python, vllm_env

    done = subprocess.run([str(engine_python()), str(REPO / "engines" / "offload_events.py"), str(tmp_path)],
                          env=vllm_env(VllmOptions()), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fix = REPO / "tests" / "fixtures" / "vllm-0.32"
    for name in ("kv-events-offload.bin", "kv-events-offload.json"):
        assert (tmp_path / name).read_bytes() == (fix / name).read_bytes(), name
