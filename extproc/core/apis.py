"""The APIs a request may speak, each read into the conversation the engine will render (DESIGN "APIs").

vLLM turns an Anthropic Messages request and a Responses request into the same chat prompt as a chat request:
the system text first, the tools (the chat template renders them beside it), then every message. A body's raw
bytes do not follow that order (the SDKs write keys alphabetically: ``messages`` before ``system``, ``input``
before ``instructions``), and they carry what never reaches the prompt and moves from turn to turn (Claude Code
marks its newest message with ``cache_control``). So for these two APIs the prefix chain is hashed over the
conversation written out in the engine's order, with only what the template reads: two sessions sharing a system
prompt and tools share their first blocks, and a conversation's next turn extends its last one.

Stored responses (``VLLM_ENABLE_RESPONSES_API_STORE``) live in the memory of the replica that created them. The
brain names each new response itself: vLLM takes a request's ``request_id`` as the response's id, and the id the
brain writes there says which replica holds it and which conversation it continues (``mint_response_id``). A
follow-up (``previous_response_id``), a retrieval or a cancel is then sent to that replica by reading the id
alone: no response is read on its way back, nothing is shared between brains, and a restarted brain still knows
(the id is the state). Ids a client set itself are remembered for a while (``ResponseHomes``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import json
import os
import re
from collections import OrderedDict
from typing import Any, Iterable, Mapping

import orjson


class Api(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"  # Anthropic Messages (and count_tokens)
    RESPONSES = "responses"  # POST /v1/responses: creates a response, maybe following a stored one
    STORED_RESPONSE = "stored_response"  # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel
    OTHER = "other"


MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_RESPONSES = "/v1/responses"


def api_of(path: str | None) -> Api:
    """The API of a request's path (without its query)."""
    if not path:
        return Api.OTHER
    if path == "/v1/chat/completions":
        return Api.CHAT
    if path == "/v1/completions":
        return Api.COMPLETIONS
    if path in MESSAGES_PATHS:
        return Api.MESSAGES
    if path == _RESPONSES:
        return Api.RESPONSES
    if stored_response_id(path) is not None:
        return Api.STORED_RESPONSE
    return Api.OTHER


def stored_response_id(path: str) -> str | None:
    """The id in ``/v1/responses/{id}`` or ``/v1/responses/{id}/cancel``."""
    if not path.startswith(_RESPONSES + "/"):
        return None
    rest = path[len(_RESPONSES) + 1:]
    if rest.endswith("/cancel"):
        rest = rest[: -len("/cancel")]
    return rest if rest and "/" not in rest else None


# --- the conversation as the engine renders it ---------------------------------------------------------------

_MAX_DEPTH = 16  # blocks nested in blocks (tool results); a client's deeper nesting is kept as sent


def _block(block: Any, depth: int = 0) -> Any:
    """A content block as the template reads it: a text block is its text; another block (tool use, tool result,
    image) keeps its fields but not ``cache_control``, a hint to Anthropic's cache that vLLM never renders."""
    if isinstance(block, dict) and depth < _MAX_DEPTH:
        if block.get("type") in ("text", "input_text", "output_text") and isinstance(block.get("text"), str):
            return block["text"]
        return {k: (_content(v, depth + 1) if k == "content" else v) for k, v in block.items() if k != "cache_control"}
    return block


def _content(content: Any, depth: int = 0) -> Any:
    if isinstance(content, list) and depth < _MAX_DEPTH:
        parts = [_block(b, depth) for b in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
        return parts
    return content


def _text(content: Any) -> str:
    c = _content(content)
    return c if isinstance(c, str) else ""


def _messages_conversation(doc: Mapping[str, Any]) -> tuple[str, Any, list]:
    system = doc.get("system")
    msgs = doc.get("messages")
    out = [{"role": m.get("role"), "content": _content(m.get("content"))}
           for m in (msgs if isinstance(msgs, list) else ()) if isinstance(m, dict)]
    return _text(system), doc.get("tools"), out


def _responses_conversation(doc: Mapping[str, Any]) -> tuple[str, Any, list]:
    system = doc.get("instructions")
    inp = doc.get("input")
    out: list = []
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if isinstance(item, dict) and "role" in item and "content" in item:
                out.append({"role": item.get("role"), "content": _content(item.get("content"))})
            elif isinstance(item, (dict, str)):
                out.append(_block(item))
    return (system if isinstance(system, str) else ""), doc.get("tools"), out


def conversation_bytes(api: Api, doc: Mapping[str, Any], follows: bool = False) -> bytes | None:
    """The conversation of a Messages or Responses body in the engine's order (system, tools, messages), written
    the same way for every turn; None for the other APIs, whose raw bytes already are in that order. ``follows``:
    the body follows a stored response, whose system and tools the engine already put first: its messages only."""
    if api not in (Api.MESSAGES, Api.RESPONSES):
        return None
    system = ""
    try:
        system, tools, msgs = (_messages_conversation if api is Api.MESSAGES else _responses_conversation)(doc)
        if follows:
            return b',"messages":' + orjson.dumps(msgs)
        return b"".join((b'"system":', orjson.dumps(system), b',"tools":', orjson.dumps(tools or []),
                         b',"messages":', orjson.dumps(msgs)))
    except (TypeError, RecursionError):
        # numbers past 64 bits, nesting past orjson's 254 levels: nothing an engine renders differently; skip them
        return b'"system":' + orjson.dumps(system)


def session_of_messages(doc: Mapping[str, Any]) -> str | None:
    """Anthropic's ``metadata.user_id``: Claude Code writes the session's id into it."""
    meta = doc.get("metadata")
    v = meta.get("user_id") if isinstance(meta, dict) else None
    return v if isinstance(v, str) and v else None


# --- stored responses ----------------------------------------------------------------------------------------

_MINTED = "resp_wr2"  # a version digit: wr1 ids carried no MAC, so anybody could write one naming any replica
_TAG, _ROOT, _RAND, _MAC = 12, 16, 16, 16  # hex characters
# the key ids are signed with when the caller names none: this process's own (the brain is given the fleet's, or
# its key file's, at start: brain.response_key_file, shared_state.secret_file)
PROCESS_KEY = os.urandom(32)


@functools.lru_cache(maxsize=4096)
def replica_tag(name: str) -> str:
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=_TAG // 2).hexdigest()


def _id_mac(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()[:_MAC]


def mint_response_id(replica: str, root: str | None, key: bytes = PROCESS_KEY) -> str:
    """A new response's id: the replica that will hold it, the conversation it belongs to (``root``: from the
    response it follows; None: a new conversation), 64 random bits and a MAC of them under ``key``, so that no
    client can write an id that sends its request to a replica of its choosing. Only a hash of the replica's name
    is in it."""
    if root is None or len(root) != _ROOT:
        root = os.urandom(_ROOT // 2).hex()
    body = f"{replica_tag(replica)}{root}{os.urandom(_RAND // 2).hex()}"
    return f"{_MINTED}{body}{_id_mac(key, body)}"


def with_request_id(body: bytes, response_id: str) -> bytes:
    """``body`` (a JSON object without ``request_id``) with one, first: every other byte kept."""
    at = body.find(b"{")
    rest = body[at + 1:]
    sep = b"" if rest.lstrip().startswith(b"}") else b","
    return body[:at + 1] + b'"request_id":' + orjson.dumps(response_id) + sep + rest


KV_TRANSFER_KEY = "kv_transfer_params"
# its fields a connector acts on (vLLM's NIXL connector and its P2P peers: where the KV is, whose it is, which way)
KV_TRANSFER_FIELDS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
                      "remote_request_id", "remote_bootstrap_addr")
# an escape of one of the key's letters ("kv\u005ftransfer_params" is the same key to the engine's parser): k v t r a n
# s f e p m are \u006x and \u007x, the underscore \u005f; ordinary JSON escapes none of them
_KEY_LETTER_ESCAPE = re.compile(rb"\\u00[5-7]")


def without_kv_transfer(body: bytes, known: bool | None, escapes: bool) -> bytes | None:
    """``body`` without a top-level ``kv_transfer_params`` (None: it has none, or is no JSON object). Only the
    brain's prefill leg may tell an engine where KV comes from: a client's would make the decode replica connect to a
    host the client named, or consume another request's transfer by its id. Read as the engine reads it (escapes
    decoded, the last duplicate key).

    ``known``: what the profile's parse found (True/False; None: the body was not parsed, too big). An unparsed body is
    searched for the key (~0.2 ms a MB here) and, with ``escapes``, for an escaped letter of it (~0.5 ms a MB more:
    the brain asks it where a connector certainly reads the field, a fleet with prefill replicas); parsed only when
    the bytes may spell the key."""
    if known is False:
        return None
    if known is None and KV_TRANSFER_KEY.encode() not in body \
            and not (escapes and _KEY_LETTER_ESCAPE.search(body) is not None):
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:  # NaN, Infinity: the engine's own parser reads them, and its writer keeps them
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict) or KV_TRANSFER_KEY not in doc:
            return None
        del doc[KV_TRANSFER_KEY]
        return json.dumps(doc, ensure_ascii=False).encode()
    if not isinstance(doc, dict) or KV_TRANSFER_KEY not in doc:
        return None
    del doc[KV_TRANSFER_KEY]
    return orjson.dumps(doc)


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


def parse_minted(response_id: str) -> tuple[str, str] | None:
    """(replica tag, conversation root) of an id in the brain's minted form (its MAC not checked: ``verify_minted``);
    None for any other id."""
    if not response_id.startswith(_MINTED) or len(response_id) != len(_MINTED) + _TAG + _ROOT + _RAND + _MAC:
        return None
    rest = response_id[len(_MINTED):]
    if not _is_hex(rest):
        return None
    return rest[:_TAG], rest[_TAG:_TAG + _ROOT]


def verify_minted(response_id: str, key: bytes) -> bool:
    """An id in the minted form whose MAC is ``key``'s."""
    body, mac = response_id[len(_MINTED):-_MAC], response_id[-_MAC:]
    return parse_minted(response_id) is not None and hmac.compare_digest(mac, _id_mac(key, body))


def conversation_root(response_id: str) -> str:
    """The conversation a stored response belongs to: the root its minted id carries, or a hash of a foreign id."""
    minted = parse_minted(response_id)
    if minted is not None:
        return minted[1]
    return hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"), digest_size=_ROOT // 2).hexdigest()


class ResponseHomes:
    """Which replica holds each stored response whose id the client chose itself (vLLM's ``request_id``): minted
    ids need no entry. Bounded by count and age, oldest first."""

    def __init__(self, max_entries: int = 100_000, max_age_s: float = 6 * 3600.0):
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._homes: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    @staticmethod
    def _key(response_id: str, tenant: str | None = None) -> bytes:
        # a client's id may be anything it chose: kept as a hash, like every other key; scoped by the tenant
        # (when one is known), so one tenant's id never names another's response
        h = hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"), digest_size=16)
        if tenant:
            h.update(b"\0" + tenant.encode("utf-8", "surrogatepass"))
        return h.digest()

    def record(self, response_id: str, replica: str, now: float, tenant: str | None = None) -> bool:
        """Remember where a client-named response lives. The first writer wins: a create that reuses an id whose
        response is still remembered does not move it (another client re-homed its victim's follow-ups so).
        False when the id was taken."""
        key = self._key(response_id, tenant)
        self.expire(now)
        if key in self._homes:
            return False
        self._homes[key] = (replica, now)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)
        return True

    def expire(self, now: float) -> None:
        while self._homes:
            _, (_, at) = next(iter(self._homes.items()))
            if now - at <= self.max_age_s:
                break
            self._homes.popitem(last=False)

    def get(self, response_id: str, now: float, tenant: str | None = None) -> str | None:
        entry = self._homes.get(self._key(response_id, tenant))
        if entry is None or now - entry[1] > self.max_age_s:
            return None
        return entry[0]


class Holder(enum.Enum):
    UNKNOWN = "unknown"  # an id neither minted nor remembered: any replica may hold it
    GONE = "gone"  # the replica that held it is no longer in the fleet: the response went with it
    # in the minted form without this fleet's MAC: no brain made it, no replica is chosen by its bytes; answered
    # as the replica it names would answer an id it never stored (404). An old unsigned wr1 id is no longer read
    # as minted: it is any client's id (UNKNOWN), routed as any request is
    FORGED = "forged"


def holder_of(response_id: str, replicas: Iterable[str], homes: ResponseHomes, now: float,
              key: bytes = PROCESS_KEY, tenant: str | None = None) -> "str | Holder":
    """The replica holding a stored response (a name), or why none can be named."""
    minted = parse_minted(response_id)
    names = list(replicas)
    if minted is not None:
        if not verify_minted(response_id, key):
            return Holder.FORGED
        for name in names:
            if replica_tag(name) == minted[0]:
                return name
        return Holder.GONE
    home = homes.get(response_id, now, tenant)
    if home is None:
        return Holder.UNKNOWN
    return home if home in names else Holder.GONE


def response_not_found_body(response_id: str) -> dict:
    """vLLM 0.32's answer for a stored response it does not hold (``OpenAIServingResponses._make_not_found_error``)."""
    return {"error": {"message": f"Response with id '{response_id[:200]}' not found.", "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}


def anthropic_error_body(openai_body: Mapping[str, Any]) -> dict:
    """An error in OpenAI's shape as vLLM answers it on the Messages paths (``translate_error_response``)."""
    found = openai_body.get("error")
    err: Mapping[str, Any] = found if isinstance(found, dict) else {}
    return {"type": "error", "error": {"type": str(err.get("type", "error")), "message": str(err.get("message", ""))}}
