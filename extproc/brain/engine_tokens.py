"""A request's tokens as the engine makes them: the model's own chat template and tokenizer, from the
files the engine loads, so that its prompt can be hashed into the blocks the engine's KV events name.

vLLM renders a chat request with the model's template under Hugging Face's conventions (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, ``add_generation_prompt`` true unless the request says
otherwise, its ``tools`` and ``chat_template_kwargs`` passed in) and tokenizes the text without adding special
tokens (the template writes them). What this cannot reproduce (images, audio, a template that fails here) gives
None, and the estimate prices that request.

A conversation's next turn re-renders the same text with more at its end, so only the new part is tokenized: the
tokenizer splits text at its added special tokens before anything else, so the tokens of everything up to the end
of the last special token are the same however the text goes on (a tokenizer whose special tokens strip the
whitespace around them gets no such cut: it is tokenized whole). Per session: the prefix's length and digest and
its tokens, least recently used first out past ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.apis import Api
from ..core.engine_cache import chain, external
from .engine_render import Unrenderable, chat_request, content_format, conversation

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


class TokenizerError(ValueError):
    pass


def _template_of(model_dir: Path) -> str:
    for name in TEMPLATE_FILES:
        p = model_dir / name
        if not p.is_file():
            continue
        if name.endswith(".jinja"):
            return p.read_text()
        doc = json.loads(p.read_text())
        t = doc.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if isinstance(t, str):
            return t
    raise TokenizerError(f"{model_dir}: no chat template ({', '.join(TEMPLATE_FILES)})")


class ChatTokens:
    """One model's template and tokenizer (``model_dir``: the directory the engine loads the model from;
    ``chat_template``: the file its engines were given with --chat-template, if any)."""

    def __init__(self, model_dir: str | Path, max_bytes: int = 64 << 20, chat_template: str | Path | None = None):
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json")
        self.tokenizer_json = str(d / "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(self.tokenizer_json)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])

        def raise_exception(message: str) -> None:
            raise TokenizerError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        source = Path(chat_template).read_text() if chat_template else _template_of(d)
        self.template = env.from_string(source)
        self.format = content_format(source)
        self.developer_role = '"developer"' in source or "'developer'" in source
        try:  # vLLM's probe: a template that refuses a second system message gets Messages' merged into the first
            self.template.render(messages=[{"role": r, "content": "t"} for r in ("system", "user") * 2],
                                 add_generation_prompt=False)
            self.merge_inline_system = False
        except Exception:
            self.merge_inline_system = True
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        self.specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                         if isinstance(config.get(k), str)}
        added = json.loads((d / "tokenizer.json").read_text()).get("added_tokens") or []
        # the cut is safe only where an added token cannot take whitespace from what follows or precedes it
        cuts = {a["id"]: a["content"] for a in added if isinstance(a, dict) and isinstance(a.get("content"), str)
                and isinstance(a.get("id"), int) and a.get("special") and not a.get("lstrip") and not a.get("rstrip")}
        if any(a.get("lstrip") or a.get("rstrip") for a in added if isinstance(a, dict)):
            cuts = {}
        self.cut_content = cuts
        self.cut_ids = frozenset(cuts)
        self.cuts = tuple(set(cuts.values()))
        self.max_bytes = max_bytes
        self._memo: OrderedDict[bytes, _Memo] = OrderedDict()
        self._memo_bytes = 0
        self.reused_tokens = self.encoded_tokens = self.reused_blocks = self.hashed_blocks = 0

    @property
    def sessions_kept(self) -> int:
        """Sessions whose rendering and tokens are kept for their next turn."""
        return len(self._memo)

    def render(self, body: dict, api: Api = Api.CHAT) -> str | None:
        """A chat completions, Messages or Responses body as the engine's prompt text, or None when it cannot be
        rendered here exactly."""
        req = chat_request(body, api, self.merge_inline_system)
        if req is None or not req.get("messages"):
            return None
        try:
            messages = conversation(req["messages"], self.format, self.developer_role)
        except (Unrenderable, KeyError, TypeError, AttributeError):
            return None  # images, audio, files: the engine adds what is not text here
        kwargs: dict[str, Any] = dict(req.get("chat_template_kwargs") or {})
        kwargs.setdefault("add_generation_prompt", req.get("add_generation_prompt", True))
        if req.get("continue_final_message"):
            kwargs["add_generation_prompt"] = False
        try:
            return self.template.render(messages=messages, tools=req.get("tools"), **self.specials, **kwargs)
        except Exception:  # a template error: vLLM would answer 400, and this request is estimated
            return None

    def tokens(self, body: dict, key: bytes | None = None, api: Api = Api.CHAT) -> array | None:
        """The prompt's token ids for a body of ``api``; ``key`` (its session) to tokenize only what is new since
        that session's last turn."""
        got = self.prompt(body, key, api)
        assert not isinstance(got, Later)  # no inline_chars: tokenized here
        return got[0] if got is not None else None

    def prompt(self, body: dict, key: bytes | None = None, api: Api = Api.CHAT,
               blocks: Blocks | None = None,
               inline_chars: int | None = None) -> tuple[array, tuple[int, ...] | None] | Later | None:
        """(the prompt's token ids, their full blocks' hashes as the engine publishes them when ``blocks`` = (block
        size, root digest, cache salt) is given), or None when the body cannot be rendered here. A session's turn
        (``key``) tokenizes the text after the last special token of its last turn and hashes only blocks past
        what both turns share. More than ``inline_chars`` of text to tokenize: ``Later(text)``, for ``learn``."""
        text = self.render(body, api)
        if text is None:
            return None
        memo = self._memo.get(key) if key is not None else None
        head, start, old = _EMPTY, 0, None
        if memo is not None and len(text) >= memo.cut and \
                hashlib.blake2b(text[:memo.cut].encode(), digest_size=16).digest() == memo.digest:
            head, start, old = memo.head, memo.cut, memo.chain
        if inline_chars is not None and len(text) - start > inline_chars:
            return Later(text)
        if memo is not None and key is not None:
            del self._memo[key]
            self._memo_bytes -= memo.size
        enc = self.tokenizer.encode(text[start:], add_special_tokens=False)
        toks = head + array("I", enc.ids)
        self.reused_tokens += len(head)
        self.encoded_tokens += len(enc.ids)
        chain_of = self._hashes(toks, blocks, old, len(head)) if blocks is not None else None
        if key is not None and self.cuts:
            self._remember(key, text, start, len(head), toks, chain_of)
        return toks, (chain_of[4] if chain_of is not None else None)

    def _hashes(self, toks: array, blocks: Blocks, old: tuple | None, shared: int) -> tuple:
        """(block size, root, salt, LoRA key, published hashes, their full digests end to end): the blocks inside
        what this turn shares with the session's last (``shared`` tokens, hashed then into ``old``) are taken
        from it."""
        bs, root, salt, lora = _blocks(blocks)
        n = len(toks) // bs
        prior = old if old is not None and old[:4] == (bs, root, salt, lora) else None
        reuse = min(len(prior[4]), shared // bs, n) if prior is not None else 0
        parent = prior[5][(reuse - 1) * 32:reuse * 32] if reuse and prior is not None else None
        digests = chain(toks[reuse * bs:n * bs], bs, root, parent, extra=extra_keys(n - reuse, salt if not reuse
                                                                                     else None, lora))
        self.reused_blocks += reuse
        self.hashed_blocks += len(digests)
        kept = prior if reuse and prior is not None else None
        hashes = (kept[4][:reuse] if kept is not None else ()) + tuple(external(d) for d in digests)
        return bs, root, salt, lora, hashes, (kept[5][:reuse * 32] if kept is not None else b"") + b"".join(digests)

    def _remember(self, key: bytes, text: str, start: int, shared: int, toks: array, chain_of) -> None:
        """Keep this turn's text up to its last special token, the tokens of that text and this turn's chain: the
        chain is of these tokens, which begin with the kept ones (what a next turn that matches may reuse)."""
        cut = max((text.rfind(s) + len(s) if text.rfind(s) >= start else -1) for s in self.cuts)
        if cut <= start:
            return
        # the tokenizer writes each of these strings as its own id, so the last such id in the tokens is the cut's
        # (found from the end: a template's text after its last special token is a few tokens)
        at = next((i for i in range(len(toks) - 1, shared - 1, -1) if toks[i] in self.cut_ids), None)
        if at is None or text.rfind(self.cut_content[toks[at]]) + len(self.cut_content[toks[at]]) != cut:
            return
        m = _Memo(cut, hashlib.blake2b(text[:cut].encode(), digest_size=16).digest(), toks[:at + 1], chain_of)
        self._memo[key] = m
        self._memo_bytes += m.size
        while self._memo_bytes > self.max_bytes and self._memo:
            _, gone = self._memo.popitem(last=False)
            self._memo_bytes -= gone.size


    def extends(self, key: bytes | None) -> bool:
        """Whether a turn of session ``key`` would extend tokens this holds (its last turn's)."""
        return key is not None and key in self._memo

    def learn(self, key: bytes, text: str, toks: array) -> None:
        """A session's prompt tokenized elsewhere (a worker process): its next turn extends it. Not over a memo of
        a longer text (a later turn already tokenized)."""
        memo = self._memo.get(key)
        if not self.cuts or (memo is not None and memo.cut >= len(text)):
            return
        if memo is not None:
            del self._memo[key]
            self._memo_bytes -= memo.size
        self._remember(key, text, 0, 0, toks, None)


@dataclass(frozen=True, slots=True)
class Later:
    """A prompt too long to tokenize on the request path, for a worker: its text, or (not read yet) its body's bytes and
    its API."""

    text: str | None
    request: "tuple[bytes, Api] | None" = None


def encode_in_worker(tokenizer_json: str, text: str) -> bytes:
    """A prompt's token ids, in a worker process that loaded the tokenizer once (the ids as uint32 bytes)."""
    tok = _WORKER_TOKENIZERS.get(tokenizer_json)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _WORKER_TOKENIZERS[tokenizer_json] = Tokenizer.from_file(tokenizer_json)
    return array("I", tok.encode(text, add_special_tokens=False).ids).tobytes()


def render_in_worker(model_dir: str, chat_template: str | None, body: bytes, api: Api) -> tuple[str, bytes] | None:
    """A request body read, rendered as the engine renders it, and tokenized, in a worker process that loaded the
    model's template and tokenizer once: (text, ids as uint32 bytes), or None when it cannot be rendered here."""
    import orjson

    key = f"{model_dir}\0{chat_template}"
    ct = _WORKER_CHATS.get(key)
    if ct is None:
        ct = _WORKER_CHATS[key] = ChatTokens(model_dir, chat_template=chat_template)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    text = ct.render(doc, api) if isinstance(doc, dict) else None
    if text is None:
        return None
    return text, array("I", ct.tokenizer.encode(text, add_special_tokens=False).ids).tobytes()


_WORKER_CHATS: dict[str, "ChatTokens"] = {}
_WORKER_TOKENIZERS: dict[str, Any] = {}
_EMPTY = array("I")


class _Memo:
    __slots__ = ("cut", "digest", "head", "chain", "size")

    def __init__(self, cut: int, digest: bytes, head: array, chain_of: tuple | None):
        self.cut, self.digest, self.head, self.chain = cut, digest, head, chain_of
        self.size = 4 * len(head) + 128 + (40 * len(chain_of[4]) + len(chain_of[5]) if chain_of is not None else 0)


# (block size, root digest, cache salt[, the LoRA key ("lora", name, path)]): what a request's chain depends on
Blocks = tuple


def _blocks(b: Blocks) -> tuple:
    return (*b, None) if len(b) == 3 else tuple(b)


def extra_keys(n: int, cache_salt: str | None, lora: tuple | None) -> list | None:
    """Each of ``n`` blocks' extra keys as vLLM tags them (``generate_block_hash_extra_keys``): the adapter's on
    every block, then the cache salt on the prompt's first."""
    if not n or (cache_salt is None and lora is None):
        return None
    base = (lora,) if lora is not None else ()
    first = base + ((("cache_salt", cache_salt),) if cache_salt else ())
    return [first or None] + [base or None] * (n - 1)


def block_hashes(tokens, block_size: int, root: bytes, cache_salt: str | None = None,
                 lora: tuple | None = None) -> tuple[int, ...]:
    """What the engine publishes for the prompt's full blocks (an adapter's key on each, a cache salt on block 0)."""
    n = len(tokens) // block_size
    return tuple(external(d) for d in chain(tokens, block_size, root, extra=extra_keys(n, cache_salt, lora)))
