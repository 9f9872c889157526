"""The mock's answers in vLLM's shapes: a prompt's text and token ids, usage, a whole body, a streamed chunk, an
error as vLLM's FastAPI writes it."""

from __future__ import annotations

import hashlib
import json
import zlib

from aiohttp import web

from extproc.core.blocks import BLOCK_CHARS, block_hashes

CHARS_PER_TOKEN = 4


def text_token_ids(text: str) -> list[int]:
    """Deterministic token ids, 4 characters a token: equal prefixes give equal ids."""
    return [int.from_bytes(hashlib.blake2b(text[i : i + 4].encode("utf-8", "replace"), digest_size=2).digest(), "big")
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def prompt_text(doc: dict) -> str:
    msgs = doc.get("messages")
    if isinstance(msgs, list):
        return "".join(content_text(m.get("content")) for m in msgs if isinstance(m, dict))
    p = doc.get("prompt", doc.get("input", doc.get("text", "")))
    if isinstance(p, str):
        return p
    return "".join(x for x in p if isinstance(x, str)) if isinstance(p, list) else ""


async def json_object(request: web.Request) -> dict | None:
    try:
        doc = await request.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def content_text(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def usage(p: int, c: int, cached: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def final_body(chat, rid, created, model, text, p, c, cached, fp) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length",
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp,
            "choices": [choice], "usage": usage(p, c, cached)}


def chunk(chat, rid, created, model, piece, finish, fp) -> dict:
    if chat:
        delta = {"content": piece} if piece or finish is None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": fp, "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": fp,
            "choices": [{"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}]}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error(status: int, message: str, typ: str = "Bad Request", param: str | None = None) -> web.Response:
    """vLLM 0.32's error body (``ErrorResponse``): message, type, param, code; a request that fails validation
    is "Bad Request" with the field's location as param."""
    return web.json_response({"error": {"message": message, "type": typ, "param": param, "code": status}},
                             status=status)


def text_blocks(text: str) -> list[int]:
    """The prefix cache's view of a prompt: the router's own block hashes (``extproc.core.blocks``), so a
    "cache hit" means the same thing to the mock, the router and the simulator. The last, partial block
    gets a hash of its own (the engine never shares it)."""
    data = text.encode("utf-8", "replace")
    out = block_hashes(data)
    if len(data) % BLOCK_CHARS:
        out.append(zlib.crc32(data) << 32 | len(data))
    return out
