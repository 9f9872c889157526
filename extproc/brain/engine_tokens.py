"""A request's tokens as the engine makes them (issue 45): the model's own chat template and tokenizer, from the
files the engine loads, so that its prompt can be hashed into the blocks the engine's KV events name.

vLLM renders a chat request with the model's template under Hugging Face's conventions (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, ``add_generation_prompt`` true unless the request says
otherwise, its ``tools`` and ``chat_template_kwargs`` passed in) and tokenizes the text without adding special
tokens (the template writes them). What this cannot reproduce (images, audio, a template that fails here) gives
None, and the estimate prices that request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.engine_cache import chain, external

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
    """One model's template and tokenizer (``model_dir``: the directory the engine loads the model from)."""

    def __init__(self, model_dir: str | Path):
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])

        def raise_exception(message: str) -> None:
            raise TokenizerError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(_template_of(d))
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        self.specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                         if isinstance(config.get(k), str)}

    def tokens(self, body: dict) -> list[int] | None:
        """The prompt's token ids for a chat completions body, or None when it cannot be rendered here."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            if not isinstance(m, dict):
                return None
            c = m.get("content")
            if isinstance(c, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in c):
                return None  # images, audio, files: the engine adds what is not text here
        kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("add_generation_prompt", body.get("add_generation_prompt", True))
        if body.get("continue_final_message"):
            kwargs["add_generation_prompt"] = False
        try:
            text = self.template.render(messages=messages, tools=body.get("tools"), **self.specials, **kwargs)
        except Exception:  # a template error: vLLM would answer 400, and this request is estimated
            return None
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def block_hashes(tokens: list[int], block_size: int, root: bytes, cache_salt: str | None = None) -> tuple[int, ...]:
    """What the engine publishes for the prompt's full blocks (a cache salt is block 0's extra key)."""
    n = len(tokens) // block_size
    extra = [(("cache_salt", cache_salt),)] + [None] * (n - 1) if cache_salt and n else None
    return tuple(external(d) for d in chain(tokens, block_size, root, extra=extra))
