"""The request profile: session key, prefix key and token estimate (SPEC A3, B).

Keys are hashes: no prompt text or raw session id leaves this module.
A malformed, empty, non-JSON or gigantic body never raises; it yields a
profile without body keys plus ``body_status`` saying why.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from .apis import (KV_TRANSFER_KEY, Api, api_of, conversation_bytes, conversation_root, session_of_messages,
                   stored_response_id)
from .blocks import BLOCK_CHARS, ChainCache, chain_seed
from .config import ProfileConfig
from .names import BodyStatus
from .toplevel import UNKNOWN, model_candidates, scan_model

_UNREAD, _ORJSON_REFUSED = object(), object()

BODY_OK, BODY_ABSENT, BODY_EMPTY = BodyStatus.OK, BodyStatus.ABSENT, BodyStatus.EMPTY
BODY_NOT_JSON, BODY_NOT_OBJECT, BODY_TOO_LARGE = BodyStatus.NOT_JSON, BodyStatus.NOT_OBJECT, BodyStatus.TOO_LARGE
BODY_UNPARSED, BODY_ENCODED = BodyStatus.UNPARSED, BodyStatus.ENCODED
CONTENT_ENCODING = "content-encoding"
CONTENT_LENGTH = "content-length"  # a body too big to send reaches the brain as its headers and this size

# The conversation starts at the first of these keys (searched in the first 4 KiB): request
# parameters a client puts before it (max_tokens, temperature...) then do not break the chain.
_CONVERSATION_KEYS = (b'"messages"', b'"input"', b'"prompt"', b'"instructions"', b'"system"', b'"tools"')
_HEAD = 4096

_SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class RequestProfile:
    session_key: bytes | None = None
    prefix_key: bytes | None = None
    tokens: int = 0  # prompt_tokens_estimate
    body_status: BodyStatus = BODY_ABSENT
    session_source: str | None = None  # e.g. "header:x-session-id", "body:metadata.thread_id"
    blocks: Sequence[int] = ()  # C2: chained block hashes of the conversation (only for policies that read them)
    model: str | None = None  # the body's "model" (a served model, an alias, or a LoRA adapter's name)
    adapter: str | None = None  # the LoRA adapter it runs with (the catalog says which models are adapters)
    # the body could not be read as the engine reads it: its model is one of these (empty: any), never refused
    candidates: tuple[str, ...] | None = None
    provisional: bool = False  # tokens come from a size, not from a body the brain read (headers alone)
    # decided while its body is still arriving (the endpoint picker's stream past its byte limit): priced by its
    # declared size, booked only once the body has arrived (Router.arrived)
    deferred: bool = False
    api: Api = Api.OTHER  # what the path speaks
    stored_ref: str | None = None  # the stored response it follows (previous_response_id) or reads (the path's id)
    response_root: str | None = None  # the conversation of that stored response (its minted id carries it)
    response_id: str | None = None  # the id the client chose for the response it creates (vLLM's request_id)
    stores_response: bool = False  # a Responses create that may be stored (not "store": false): its id is minted
    # whose namespace a client-chosen response id lives in: the tenant, else a hash of the request's credential (two
    # clients' equal ids are two responses; without it an attacker storing first read back as the victim's)
    response_scope: str | None = None
    # the body names its own top-level kv_transfer_params (the parse says; None: not parsed, the bytes must be searched)
    kv_transfer: bool | None = None
    # flow control (core.flow): its priority class (0 critical, 1 standard, 2 sheddable) and whose fairness it counts to
    priority: int = 1
    tenant: str | None = None
    ttft_slo_s: float | None = None  # the client's time-to-first-token deadline (None: its class's)
    # the prompt as the engine tokenizes it (0: not known, the estimate prices it) and the hashes vLLM
    # publishes for its full blocks, per block size: (block_size, hashes)
    engine_tokens: int = 0
    engine_hashes: tuple[int, tuple[int, ...]] | None = None
    # decided at its request headers: a turn of a session under way, priced by its declared size and what
    # its home holds of the session; the policy keeps it on its home or answers Reason.READ_BODY
    header_path: bool = False
    # the body as parsed here (a JSON object), when it was: what reads it next (exact mode's tokenizer) reads this one
    # instead of parsing the body again. Never compared, never shown: it holds the prompt's text
    doc: Any = field(default=None, compare=False, repr=False)

    @property
    def tail(self) -> tuple[int, int] | None:
        """(block size, its last full block's hash) of a prompt priced by the engine's tokens; None otherwise."""
        h = self.engine_hashes
        return (h[0], h[1][-1]) if h is not None and h[1] else None


def hash_key(kind: str, tenant: str | None, value: str) -> bytes:
    """MD5 (A3) of kind, tenant and value, so equal values in two tenants never share a pin."""
    h = hashlib.md5(kind.encode())
    h.update(b"\x00")
    if tenant:
        h.update(tenant.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(value.encode("utf-8", "surrogatepass"))
    return h.digest()


def _text_of(content: Any) -> str:
    """Text of a message content: a string, or a list of parts ({"type": "text", "text": ...} or strings)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    parts.append(t)
                else:
                    # Responses API items nest content one level deeper.
                    inner = part.get("content")
                    if isinstance(inner, (str, list)):
                        parts.append(_text_of(inner))
        return "".join(parts)
    return ""


def _chars_of(value: Any) -> int:
    """Characters of text the model will read inside a messages/input/prompt value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        n = 0
        for item in value:
            if isinstance(item, str):
                n += len(item)
            elif isinstance(item, dict):
                if "content" in item:
                    n += len(_text_of(item["content"]))
                t = item.get("text")
                if isinstance(t, str):
                    n += len(t)
        return n
    return 0


def system_prompt(body: Mapping[str, Any]) -> str | None:
    """The text that carries the shared prefix of a request.

    Chat: the first ``system`` or ``developer`` message. Responses API:
    ``instructions`` (or the first system/developer input item). Legacy
    completions: ``prompt``. Anthropic-style ``system`` is accepted too.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES:
                return _text_of(m.get("content"))
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        return instructions
    inp = body.get("input")
    if isinstance(inp, list):
        for m in inp:
            if isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES:
                return _text_of(m.get("content"))
    system = body.get("system")
    if isinstance(system, (str, list)):
        return _text_of(system)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _body_chars(body: Mapping[str, Any]) -> int:
    n = 0
    for key in ("messages", "input", "prompt"):
        if key in body:
            n += _chars_of(body[key])
    for key in ("instructions", "system"):
        v = body.get(key)
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            n += len(_text_of(v))
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        # Tool schemas are read by the model too; agents send many of them.
        try:
            n += len(orjson.dumps(tools))
        except TypeError:
            pass
    return n


def _session_from_body(body: Mapping[str, Any], fields: tuple[str, ...]) -> tuple[str, str] | None:
    """The first configured field with a usable id, at the top level, then inside ``metadata``."""
    meta = body.get("metadata")
    for where, prefix in ((body, ""), (meta if isinstance(meta, dict) else {}, "metadata.")):
        for f in fields:
            v = where.get(f)
            if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
                return str(v), prefix + f
    return None


def _conversation_start(body: bytes) -> int:
    head = body[:_HEAD]
    found = [i for i in (head.find(k) for k in _CONVERSATION_KEYS) if i >= 0]
    return min(found) if found else 0


def _model_in(doc: Any) -> str | None:
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) and model else None


def engine_model(body: bytes, doc: Any = _UNREAD):
    """The top-level ``model`` the engine reads in ``body`` (``doc``: the body already parsed by orjson).

    vLLM reads the body with Python's ``json.loads``: the last of duplicate keys wins, escapes are decoded,
    ``NaN`` is accepted. orjson agrees on all but ``NaN``, so a body it refuses is read once more by ``json``
    itself. A body neither reads: ``UNKNOWN``."""
    if doc is _UNREAD:
        try:
            doc = orjson.loads(body)
        except (orjson.JSONDecodeError, ValueError, TypeError):
            doc = _ORJSON_REFUSED
    if doc is _ORJSON_REFUSED:
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return UNKNOWN
    return _model_in(doc)


def replace_model(body: bytes, model: str) -> bytes | None:
    """``body`` with its top-level "model" value replaced (the last one, which the engine reads), every other
    byte kept; None if it names none."""
    found, span = scan_model(body)
    if isinstance(found, str) and span is not None:
        return body[:span[0]] + orjson.dumps(model) + body[span[1]:]
    if found is UNKNOWN:  # too costly to scan: the engine's own parser, and its own writer (NaN kept)
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if isinstance(_model_in(doc), str):
            doc["model"] = model
            return json.dumps(doc, ensure_ascii=False).encode()
    return None


# the model Envoy read from a body too big to send (contract.BODY_METADATA_NAMESPACE), as the front hands it on among
# the headers: a pseudo-header, which no client can send
BODY_MODEL_KEY = ":warmroute-body-model"
BODY_KV_TRANSFER_KEY = ":warmroute-body-kv-transfer"  # such a body names kv_transfer_params (refused: 400)
BODY_ARRIVING_KEY = ":warmroute-body-arriving"  # a front decides before the body has arrived: booked when it has
# a session Envoy read from a body too big to send (json_to_metadata), by where it was: this prefix and its place
# ("conversation_id", "metadata.user_id", ...), as pseudo-headers no client can send
BODY_SESSION_PREFIX = ":warmroute-body-session:"


def envoy_session_places(fields: Sequence[str]) -> tuple[tuple[str, tuple[str, ...], Api | None], ...]:
    """Where a body names its session, in the order the brain reads a body it parses (``_session_from_body``, then
    the Messages API's ``metadata.user_id`` and the Responses API's ``session_id``): each place's name, its path of
    keys, and the one API it counts for (None: any). What Envoy reads of a body too big to send, so that its session
    is the one a parse would give."""
    return (*((f, (f,), None) for f in fields), *((f"metadata.{f}", ("metadata", f), None) for f in fields),
            ("metadata.user_id", ("metadata", "user_id"), Api.MESSAGES), ("session_id", ("session_id",), Api.RESPONSES))


def _envoy_session(headers: Mapping[str, str], cfg: ProfileConfig, api: Api) -> tuple[str, str] | None:
    """(value, place) of the session Envoy read from a body too big to send, as the parse would have found it."""
    for place, _, only in envoy_session_places(cfg.session_body_fields):
        v = headers.get(BODY_SESSION_PREFIX + place) if only is None or only is api else None
        if v:
            return v, place
    return None


# the body handed on is its first bytes only (``partial_profile``); its model as the front resolved it: BODY_MODEL_KEY
BODY_PARTIAL_KEY = ":warmroute-body-partial"


def partial_reach(cfg: ProfileConfig) -> int:
    """The bytes of a body its block chain reads at most: where the conversation starts (searched in the first
    ``_HEAD`` bytes) and ``chain_max_bytes`` of it. A chat body's first bytes past this give the chain its whole
    body would (``partial_profile``)."""
    return _HEAD + cfg.chain_max_bytes


def partial_profile(headers: Mapping[str, str], head: bytes, cfg: ProfileConfig,
                    chains: ChainCache | None) -> RequestProfile:
    """The profile of a chat or completions request decided on its body's first bytes (at least ``partial_reach``)
    while the rest still arrives: the raw-bytes block chain its whole body gives (it reads no further), its session
    from headers, its model as the front resolved it (the fleet's one model, or the model header: the body's may come
    last), its tokens from its declared size, booked once the body has passed. Nothing is parsed: the rest may name
    anything, and the engine reads that, not the brain."""
    tenant = tenant_of(headers, cfg)
    session_key, source = _session_header(headers, cfg, tenant)
    model = headers.get(BODY_MODEL_KEY) or None
    blocks: list[int] = []
    if chains is not None:
        start = _conversation_start(head)
        blocks = chains.chain(session_key, head, start, chain_seed(model, tenant), start + cfg.chain_max_bytes,
                              cfg.chain_step_bytes)
    size = max(declared_size(headers) or 0, len(head))
    return RequestProfile(session_key, None, min(int(size / cfg.chars_per_token), cfg.max_prompt_tokens),
                          BodyStatus.PARTIAL, source, blocks, model, provisional=True, deferred=True,
                          api=api_of(headers.get(":path", "").split("?", 1)[0]), tenant=tenant)


def declared_size(headers: Mapping[str, str]) -> int | None:
    """The body size a request's Content-Length declares (None: none, or not a number). Whatever a client writes
    there: ASCII digits only, and a number of 16 digits or more is read as 10^15 (no body is that big)."""
    v = headers.get(CONTENT_LENGTH, "")
    if not v or not v.isascii() or not v.isdigit():  # an ASCII string's digits are 0-9 alone
        return None
    return int(v) if len(v) < 16 else 10 ** 15


CREDENTIAL_HEADERS = ("authorization", "x-api-key")  # OpenAI's bearer token, Anthropic's key


def credential_scope(headers: Mapping[str, str]) -> str | None:
    """The request's credential, hashed at once and never kept (None: it sent none)."""
    for name in CREDENTIAL_HEADERS:
        value = headers.get(name)
        if value:
            return "credential:" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return None


def tenant_of(headers: Mapping[str, str], cfg: ProfileConfig) -> str | None:
    """The request's tenant (``cfg.tenant_source``); a credential is hashed at once and never kept."""
    name = cfg.tenant_reads()
    value = headers.get(name) if name else None
    if not value:
        return None
    if cfg.tenant_source == "credential":
        return "credential:" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return value


def _session_header(headers: Mapping[str, str], cfg: ProfileConfig, tenant: str | None) -> tuple[bytes | None,
                                                                                                 str | None]:
    """The session a header names (the first configured one present), hashed with its tenant, and its source."""
    for h in cfg.session_headers:
        v = headers.get(h)
        if v:
            return hash_key("session", tenant, v), "header:" + h
    return None, None


def header_profile(headers: Mapping[str, str], cfg: ProfileConfig) -> RequestProfile | None:
    """The profile of a request decided at its headers: its session from a session header, its prompt
    from its declared size (bounded as every declared size is), its API from its path. None: its headers name no
    session, or declare no size to price."""
    tenant = tenant_of(headers, cfg)
    session_key, source = _session_header(headers, cfg, tenant)
    size = declared_size(headers)
    if session_key is None or not size:
        return None
    tokens = min(int(size / cfg.chars_per_token), cfg.max_prompt_tokens)
    # not provisional: a size that decides is within a turn's growth of its session's last (``size_decides``), an
    # estimate as good as a body's bytes give (both count its JSON), and the engine counts its tokens as any other's
    return RequestProfile(session_key, None, tokens, BodyStatus.HEADER_PATH, source,
                          api=api_of(headers.get(":path", "").split("?", 1)[0]), tenant=tenant, header_path=True)


HEADER_GROWTH_TOKENS = 32_768  # ~128 KB of new text a turn (a coding agent's tool output); beyond, its body is read
HEADER_SHRINK = 0.9  # a turn below this share of its session's last one was compacted or rewritten: its text is read


def size_decides(last_tokens: int, tokens: int) -> bool:
    """Whether a turn's declared size lets its headers decide it, against its session's last turn: grown by no more
    than a turn adds, and not shrunk (a conversation compacted or rewritten is priced from its text). A size a client
    lies about moves nothing (the turn goes nowhere but its home) and books at most a turn's growth more."""
    return bool(last_tokens) and HEADER_SHRINK * last_tokens <= tokens <= last_tokens + HEADER_GROWTH_TOKENS


def build_profile(
    headers: Mapping[str, str],
    body: bytes | None,
    cfg: ProfileConfig,
    chains: ChainCache | None = None,
) -> RequestProfile:
    """Profile of one request. ``headers`` keys must be lower-case (as HTTP/2 and Envoy give them).

    With ``chains`` (policies that read the prefix index), the profile carries the block chain of the
    conversation, hashed from the raw bytes (a session's next turn reuses the chain of its last one),
    and its token estimate is the conversation's bytes over ``chars_per_token``; no prefix key is made.
    """
    tenant = tenant_of(headers, cfg)
    session_key, session_source = _session_header(headers, cfg, tenant)
    api = api_of(headers.get(":path", "").split("?", 1)[0])
    if api is Api.STORED_RESPONSE:  # a retrieval or a cancel: where its response lives is all there is to know
        ref = stored_response_id(headers[":path"].split("?", 1)[0])
        assert ref is not None  # api_of named it a stored response's path
        its_root = conversation_root(ref)
        if session_key is None:
            session_key, session_source = hash_key("session", tenant, "response:" + its_root), "path:response_id"
        return RequestProfile(session_key, None, 0, BODY_ABSENT if not body else BODY_OK, session_source,
                              api=api, stored_ref=ref, response_root=its_root)
    if body is not None and headers.get(BODY_PARTIAL_KEY):
        return partial_profile(headers, body, cfg, chains)

    if body is None:
        size = declared_size(headers)
        model = headers.get(BODY_MODEL_KEY) or None
        if size or model:  # Envoy sent the headers of a body too big to send (routes.big_body)
            # a declared size: a guess until the body is read, bounded by max_prompt_tokens; its model and its session
            # as Envoy read them from the body (json_to_metadata), or unknown
            tokens = min(int((size or 0) / cfg.chars_per_token), cfg.max_prompt_tokens)
            found = _envoy_session(headers, cfg, api) if session_key is None else None
            if found is not None:
                session_key, session_source = hash_key("session", tenant, found[0]), "body:" + found[1]
            return RequestProfile(session_key, None, tokens, BodyStatus.HEADERS_ONLY, session_source,
                                  candidates=None if model else (), provisional=True, model=model)
        return RequestProfile(session_key, None, 0, BODY_ABSENT, session_source)
    size = len(body)
    bytes_estimate = min(int(size / cfg.chars_per_token), cfg.max_prompt_tokens)
    if size == 0:
        return RequestProfile(session_key, None, 0, BODY_EMPTY, session_source)
    if size > cfg.max_body_bytes:
        return RequestProfile(session_key, None, bytes_estimate, BODY_TOO_LARGE, session_source, candidates=(),
                              provisional=True)
    if headers.get(CONTENT_ENCODING, "identity").strip().lower() not in ("", "identity"):
        # compressed bytes carry no key, and their size understates the prompt: count it, route by headers
        return RequestProfile(session_key, None, bytes_estimate, BODY_ENCODED, session_source, candidates=(),
                              provisional=True)
    doc: Any = None
    status = BODY_UNPARSED
    if size <= (cfg.parse_max_bytes if cfg.parse_max_bytes is not None else cfg.max_body_bytes):
        try:
            doc = orjson.loads(body)
            status = BODY_OK if isinstance(doc, dict) else BODY_NOT_OBJECT
        except (orjson.JSONDecodeError, ValueError, TypeError):
            status = BODY_NOT_JSON
    stored_ref: str | None = None
    root: str | None = None
    response_id: str | None = None
    conversation: bytes | None = None
    if status is BODY_OK and api in (Api.MESSAGES, Api.RESPONSES):
        prev = doc.get("previous_response_id") if api is Api.RESPONSES else None
        conversation = conversation_bytes(api, doc, follows=isinstance(prev, str) and bool(prev))
        if api is Api.RESPONSES:
            rid = doc.get("request_id")
            stored_ref = prev if isinstance(prev, str) and prev else None
            # a new conversation's root: its first turn and Envoy's request id, hashed (two users' identical first
            # turns are two conversations); its follow-ups find that turn's chain by it
            root = conversation_root(stored_ref) if stored_ref else hashlib.blake2b(
                (conversation or b"") + headers.get("x-request-id", "").encode("utf-8", "surrogatepass"),
                digest_size=8).hexdigest()
            response_id = rid if isinstance(rid, str) and rid else None
    if status is BODY_OK and session_key is None:
        found = _session_from_body(doc, cfg.session_body_fields)
        if found is None and api is Api.MESSAGES:
            user = session_of_messages(doc)
            found = (user, "metadata.user_id") if user else None
        if found is None and api is Api.RESPONSES:
            sid = doc.get("session_id")  # vLLM's own session field on the Responses API
            found = (sid, "session_id") if isinstance(sid, str) and sid else None
        if found is not None:
            session_key = hash_key("session", tenant, found[0])
            session_source = "body:" + found[1]
        elif root is not None:  # a follow-up belongs to the conversation of the response it continues
            session_key = hash_key("session", tenant, "response:" + root)
            session_source = "body:previous_response_id" if stored_ref else "body:response"
    stored: dict[str, Any] = {"api": api, "stored_ref": stored_ref, "response_root": root, "response_id": response_id,
              "doc": doc if status is BODY_OK else None,
              "stores_response": api is Api.RESPONSES and status is BODY_OK and doc.get("store") is not False,
              "kv_transfer": KV_TRANSFER_KEY in doc if status is BODY_OK else False if status is BODY_NOT_OBJECT
              else None}

    blocks: list[int] = []
    candidates = None
    model = engine_model(body, {BODY_UNPARSED: _UNREAD, BODY_NOT_JSON: _ORJSON_REFUSED}.get(status, doc))
    if model is UNKNOWN:  # not JSON the engine reads either: route among the names it may mean, refuse none
        model, candidates = None, model_candidates(body)
    # Messages and Responses: the conversation as the engine renders it (apis.py); others: the body from its start
    data, start = (conversation, 0) if conversation is not None else (body, None)
    earlier = 0  # bytes of the conversation the engine holds and the body does not carry (a stored response's)
    if chains is not None:
        start = _conversation_start(data) if start is None else start
        if stored_ref is not None and session_key is not None:  # the engine prepends what it stored
            blocks, known = chains.follow(session_key, data, chain_seed(model, tenant), cfg.chain_step_bytes,
                                          cfg.chain_max_bytes // BLOCK_CHARS)
            earlier = known * BLOCK_CHARS
        else:
            blocks = chains.chain(session_key, data, start, chain_seed(model, tenant), start + cfg.chain_max_bytes,
                                  cfg.chain_step_bytes)
    if status is not BODY_OK or chains is not None:
        # The warm policy needs neither the prefix key nor the text-only token count: the conversation's bytes
        # estimate its tokens the same way for every body, parsed or not (JSON adds a few percent).
        tokens = min(int((earlier + len(data) - (start or 0)) / cfg.chars_per_token), cfg.max_prompt_tokens)
        return RequestProfile(session_key, None, tokens, status, session_source, blocks, model, candidates=candidates,
                              **stored)

    prefix_key = None
    sp = system_prompt(doc)
    if sp:
        prefix_key = hash_key("prefix", tenant, sp[: cfg.prefix_chars])

    tokens = min(int(_body_chars(doc) / cfg.chars_per_token), cfg.max_prompt_tokens)
    return RequestProfile(session_key, prefix_key, tokens, BODY_OK, session_source, blocks, model, **stored)


# a request's own time-to-first-token deadline in milliseconds; llm-d's name too, so that a gateway set up for llm-d
# works unchanged. A client may set it: a deadline only ever gets its own request refused sooner
TTFT_SLO_HEADERS = ("x-warmroute-ttft-slo-ms", "x-llm-d-slo-ttft-ms")


def ttft_slo_of(headers: dict[str, str]) -> float | None:
    """The request's deadline in seconds (None: none, or not a positive number of milliseconds: its class's)."""
    for name in TTFT_SLO_HEADERS:
        v = headers.get(name)
        if v is None:
            continue
        try:
            ms = float(v.strip())
        except ValueError:
            return None
        return ms / 1000 if 0 < ms < float("inf") else None
    return None
