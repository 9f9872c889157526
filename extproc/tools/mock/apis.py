"""The mock's Anthropic Messages and Responses APIs, answered as vLLM 0.32 answers them (``entrypoints/anthropic``,
``entrypoints/openai/responses``): the same prompt as chat (system or instructions first, then the messages), the
answer in each API's shape, streamed as each API's events, and stored responses held in this process's memory
only (``VLLM_ENABLE_RESPONSES_API_STORE``; the mock's ``--responses-store``)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from extproc.core.apis import response_not_found_body

BLOCK_TOKENS = 16  # the mock's prefix-cache block (vLLM on CPU: 128)
MAX_STORED = 10_000  # vLLM keeps every stored response until it exits; the mock forgets the oldest past this


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def messages_prompt(doc: dict) -> str | None:
    """The prompt text of a Messages body (None: not one vLLM would take)."""
    msgs = doc.get("messages")
    if not isinstance(msgs, list):
        return None
    return _text(doc.get("system")) + "".join(_text(m.get("content")) for m in msgs if isinstance(m, dict))


def responses_input(doc: dict) -> str:
    inp = doc.get("input")
    if isinstance(inp, str):
        return inp
    if isinstance(inp, list):
        return "".join(_text(i.get("content")) if isinstance(i, dict) else str(i) for i in inp)
    return ""


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class MessagesShape:
    """Anthropic's message and its stream (message_start ... message_stop)."""

    def __init__(self, model: str):
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def _usage(self, p: int, c: int, cached: int) -> dict:
        # vLLM 0.32 (_build_anthropic_usage), Anthropic's definition: the prompt is input + cache read + cache
        # creation; what this request wrote into the prefix cache (its new whole blocks) is the creation
        created = max(0, p // BLOCK_TOKENS * BLOCK_TOKENS - cached)
        return {"input_tokens": max(0, p - cached - created), "output_tokens": c, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": created}

    def start(self, p: int) -> list[bytes]:
        msg = {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": 0}}
        return [_sse("message_start", {"type": "message_start", "message": msg}),
                _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})]

    def piece(self, text: str) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": text}})

    def end(self, text: str, p: int, c: int, cached: int) -> list[bytes]:
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                                          "stop_sequence": None},
                                       "usage": self._usage(p, c, cached)}),
                _sse("message_stop", {"type": "message_stop"})]

    def body(self, text: str, p: int, c: int, cached: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens", "stop_sequence": None,
                "usage": self._usage(p, c, cached)}


class ResponsesShape:
    """A Responses API response and its stream (response.created ... response.completed)."""

    def __init__(self, model: str, response_id: str, doc: dict):
        self.model = model
        self.id = response_id
        self.doc = doc
        self.created = int(time.time())
        self.msg_id = "msg_" + uuid.uuid4().hex[:24]
        self.seq = 0

    def response(self, status: str, text: str | None = None, usage: dict | None = None) -> dict:
        output = [] if text is None else [{
            "type": "message", "id": self.msg_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}]
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": output, "instructions": self.doc.get("instructions"),
                "previous_response_id": self.doc.get("previous_response_id"), "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "background": bool(self.doc.get("background")),
                "store": self.doc.get("store", True) is not False, "usage": usage, "error": None,
                "incomplete_details": None, "metadata": None, "text": {"format": {"type": "text"}}}

    @staticmethod
    def usage(p: int, c: int, cached: int) -> dict:
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return _sse(kind, {"type": kind, "sequence_number": self.seq, **fields})

    def start(self, p: int) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": []}
        item = {"type": "message", "id": self.msg_id, "role": "assistant", "status": "in_progress", "content": []}
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress")),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", output_index=0, content_index=0, item_id=self.msg_id,
                            part=part)]

    def piece(self, text: str) -> bytes:
        return self._event("response.output_text.delta", output_index=0, content_index=0, item_id=self.msg_id,
                           delta=text, logprobs=[])

    def end(self, text: str, p: int, c: int, cached: int) -> list[bytes]:
        done = self.response("completed", text, self.usage(p, c, cached))
        return [self._event("response.output_text.done", output_index=0, content_index=0, item_id=self.msg_id,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", output_index=0, content_index=0, item_id=self.msg_id,
                            part=done["output"][0]["content"][0]),
                self._event("response.output_item.done", output_index=0, item=done["output"][0]),
                self._event("response.completed", response=done)]

    def body(self, text: str, p: int, c: int, cached: int) -> dict:
        return self.response("completed", text, self.usage(p, c, cached))


class ResponseStore:
    """Stored responses of this process: each with the conversation text it ends (the next turn's prompt)."""

    def __init__(self):
        self.responses: OrderedDict[str, dict] = OrderedDict()
        self.history: dict[str, str] = {}

    def put(self, response: dict, history: str) -> None:
        self.responses[response["id"]] = response
        self.history[response["id"]] = history
        while len(self.responses) > MAX_STORED:
            old, _ = self.responses.popitem(last=False)
            self.history.pop(old, None)

    def get(self, response_id: str) -> dict | None:
        return self.responses.get(response_id)


def not_found(response_id: str) -> tuple[int, dict]:
    return 404, response_not_found_body(response_id)
