"""A request's tokens as the engine makes them, and a conversation tokenized only where it is new (issue 45). The
tokenizer and chat template are the tiny model's that `make engines` builds and vLLM loads (copied into
tests/fixtures/tiny-llama-tokenizer); that vLLM counts them alike is checked against the real engine in
tests/integration/test_real_vllm.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.brain.engine_tokens import ChatTokens, block_hashes
from extproc.core.engine_cache import chain, external, none_hash

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CT = ChatTokens(FIX / "tiny-llama-tokenizer")


def test_a_prompt_renders_and_tokenizes_as_the_real_engine_did():
    recorded = json.loads((FIX / "vllm-0.32" / "kv-events-prompt.json").read_text())
    body = {"messages": [{"role": "user", "content": recorded["prompt"]}]}
    assert list(CT.tokens(body)) == recorded["tokens"]  # vLLM 0.32's /tokenize of the same request
    assert block_hashes(recorded["tokens"], 128, none_hash()) == tuple(
        external(d) for d in chain(recorded["tokens"], 128, none_hash()))


def test_what_cannot_be_rendered_here_is_left_to_the_estimate():
    assert CT.tokens({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}) is None
    assert CT.tokens({"messages": []}) is None and CT.tokens({"prompt": "x"}) is None


# pieces a chat carries, special tokens written inside a message included (the tokenizer splits at them too)
text = st.lists(st.sampled_from(list("ab cd\n\té語<|>_") + ["<|im_end|>", "<|im_start|>", "  ", "def f():"]),
                max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), text), min_size=1, max_size=8))
def test_a_conversation_tokenized_turn_by_turn_is_the_whole_tokenized_at_once(turns):
    inc = ChatTokens(FIX / "tiny-llama-tokenizer")
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    for role, content in turns:
        msgs.append({"role": role, "content": content})
        body = {"messages": list(msgs)}
        assert list(inc.tokens(body, b"session")) == list(CT.tokens(body))
    assert inc.reused_tokens > 0 or len(turns) == 1


def test_a_turn_costs_what_is_new_and_a_different_history_is_tokenized_whole():
    inc = ChatTokens(FIX / "tiny-llama-tokenizer")
    msgs = [{"role": "system", "content": "tool output line. " * 2000}]
    for k in range(5):
        msgs.append({"role": "user", "content": f"turn {k}: " + "more context. " * 50})
        inc.tokens({"messages": msgs}, b"s")
    whole = len(CT.tokens({"messages": msgs}))
    assert inc.encoded_tokens < whole * 1.5, (inc.encoded_tokens, whole)  # not five times the conversation
    edited = [{"role": "system", "content": "another system prompt"}] + msgs[1:]
    before = inc.encoded_tokens
    assert list(inc.tokens({"messages": edited}, b"s")) == list(CT.tokens({"messages": edited}))
    assert inc.encoded_tokens - before == len(CT.tokens({"messages": edited}))


def test_the_memo_is_bounded_by_its_bytes():
    small = ChatTokens(FIX / "tiny-llama-tokenizer", max_bytes=20_000)
    for k in range(50):
        small.tokens({"messages": [{"role": "user", "content": f"session {k} " * 200}]}, f"s{k}".encode())
    assert small._memo_bytes <= 20_000 and 0 < len(small._memo) < 50


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), text), min_size=1, max_size=6),
       st.sampled_from([1, 4, 16]), st.booleans(), st.sampled_from([None, "salt"]))
def test_a_session_s_chain_extended_turn_by_turn_is_the_chain_of_the_whole(turns, bs, rewrite, salt):
    """The blocks a turn shares with the session's last are taken from it, the rest hashed: always the chain of
    the whole prompt, an edited history included."""
    inc = ChatTokens(FIX / "tiny-llama-tokenizer")
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    for k, (role, content) in enumerate(turns):
        msgs.append({"role": role, "content": content})
        if rewrite and k == len(turns) - 1:
            msgs[0] = {"role": "system", "content": "Another agent."}
        toks, hashes = inc.prompt({"messages": list(msgs)}, b"s", blocks=(bs, none_hash(), salt))
        assert toks == CT.tokens({"messages": msgs}) and hashes == block_hashes(toks, bs, none_hash(), salt)


def test_a_long_conversation_s_turn_hashes_its_new_blocks_only():
    inc = ChatTokens(FIX / "tiny-llama-tokenizer")
    msgs = [{"role": "system", "content": "tool output line. " * 3000}, {"role": "user", "content": "go"}]
    toks, _ = inc.prompt({"messages": msgs}, b"s", blocks=(128, none_hash(), None))
    before = inc.hashed_blocks
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more words. " * 100}]
    toks2, hashes = inc.prompt({"messages": msgs}, b"s", blocks=(128, none_hash(), None))
    assert inc.reused_blocks == len(toks) // 128 and inc.hashed_blocks - before == len(toks2) // 128 - len(toks) // 128
    assert hashes == block_hashes(toks2, 128, none_hash())
    # another block size (or seed) shares nothing with the chain kept
    assert inc.prompt({"messages": msgs}, b"s", blocks=(64, none_hash(), None))[1] == block_hashes(toks2, 64,
                                                                                                   none_hash())


def test_a_turn_too_long_for_the_request_path_is_tokenized_by_a_worker_and_the_next_turn_extends_it():
    """A session's first sight with more text than exact_cache.inline_chars is estimated (no engine tokens) while a
    worker process tokenizes it; the session's next turn then tokenizes only its new text, and its tokens are the
    whole prompt's."""
    from extproc.brain.brain import Brain
    from extproc.config import parse_config
    from extproc.core.apis import Api
    from extproc.core.profile import RequestProfile

    b = Brain(parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}],
                            "exact_cache": {"tokenizers": {"m": str(FIX / "tiny-llama-tokenizer")},
                                            "inline_chars": 4000}}))
    try:
        msgs = [{"role": "system", "content": "tool output line. " * 2000}, {"role": "user", "content": "go"}]
        prof = RequestProfile(session_key=b"s1", api=Api.CHAT, tokens=9000)
        first = b.exact.price(prof, json.dumps({"model": "m", "messages": msgs}).encode(), "m")
        assert first.engine_tokens == 0 and b.exact.view()["deferred_to_worker"] == 1
        msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
        body = json.dumps({"model": "m", "messages": msgs}).encode()
        deadline = time.monotonic() + 60
        while b.exact.view()["tokenized_by_worker"] == 0:  # the worker's first job loads its tokenizer
            assert time.monotonic() < deadline, b.exact.view()
            b.exact.price(RequestProfile(session_key=b"other", api=Api.CHAT, tokens=5), b'{"messages": []}', "m")
            time.sleep(0.05)  # the pace of the poll
        [ct] = b.exact.tokenizers.values()
        before = ct.encoded_tokens
        nxt = b.exact.price(prof, body, "m")
        assert nxt.engine_tokens == len(CT.tokens({"messages": msgs}))
        assert ct.encoded_tokens - before < 30  # its new text alone
    finally:
        b.exact.close()


def test_at_most_max_jobs_long_prompts_wait_for_the_worker_one_per_session():
    """Each job holds a session's whole text until the worker answers: at most MAX_JOBS at once and one per session;
    past them the request is estimated and nothing is queued; a job's end frees its place."""
    from concurrent.futures import Future

    from extproc.brain.brain import Brain
    from extproc.brain.exact import MAX_JOBS
    from extproc.config import parse_config
    from extproc.core.apis import Api
    from extproc.core.profile import RequestProfile

    class Pool:  # the worker process, held: its jobs end when the test says
        def __init__(self):
            self.jobs = []

        def submit(self, fn, *args):
            f = Future()
            self.jobs.append(f)
            return f

        def shutdown(self, **kw):
            pass

    b = Brain(parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}],
                            "exact_cache": {"tokenizers": {"m": str(FIX / "tiny-llama-tokenizer")},
                                            "inline_chars": 1000}}))
    pool = b.exact._pool = Pool()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "long text. " * 500}]}).encode()

    def price(session: bytes):
        return b.exact.price(RequestProfile(session_key=session, api=Api.CHAT, tokens=1500), body, "m")

    try:
        assert MAX_JOBS == 4  # docs/routing.md's number: each job holds a whole conversation's text
        price(b"s0")
        price(b"s0")  # already waiting: no second job for it, though places are free
        assert len(pool.jobs) == 1
        for i in range(MAX_JOBS + 2):
            assert price(f"s{i}".encode()).engine_tokens == 0
        assert len(pool.jobs) == MAX_JOBS and b.exact.view()["waiting_for_worker"] == MAX_JOBS
        pool.jobs[0].set_exception(RuntimeError("the worker died"))
        price(f"s{MAX_JOBS}".encode())  # its place is free again: the next long prompt gets it
        assert len(pool.jobs) == MAX_JOBS + 1 and b.exact.view()["waiting_for_worker"] == MAX_JOBS
    finally:
        b.exact.close()
