"""A request as the engine renders it: what vLLM 0.32 hands its chat template for a chat completions,
an Anthropic Messages or a Responses body, so that the brain's tokens are the engine's.

Each function here follows one of vLLM's, named in its docstring (``vllm/entrypoints/anthropic/serving.py``,
``vllm/entrypoints/openai/responses/utils.py``, ``vllm/renderers/chat_utils.py``, ``vllm/renderers/hf.py``).
Whatever this cannot reproduce exactly gives None and the request is estimated, as before: images and audio
(the engine adds what is not text), a Responses turn that follows a stored one (the engine prepends a
conversation the brain never saw), encrypted reasoning.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..core.apis import Api

TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
# more messages (or Responses items) than this are estimated: rendering walks each one in Python and in the
# template on the event loop, and a body of many tiny messages would cost far more than its bytes suggest
MAX_MESSAGES = 4096
BILLING_HEADER = "x-anthropic-billing-header"


class Unrenderable(ValueError):
    pass


def chat_request(doc: dict, api: Api, merge_inline_system: bool = False) -> dict | None:
    """The chat completions request vLLM makes of ``doc`` (``messages``, ``tools``, ``chat_template_kwargs``,
    ``add_generation_prompt``, ``continue_final_message``), or None when this cannot say it exactly."""
    items = doc.get("messages") if api is not Api.RESPONSES else doc.get("input")
    if isinstance(items, list) and len(items) > MAX_MESSAGES:
        return None
    try:
        if api is Api.CHAT:
            if not isinstance(doc.get("messages"), list):
                return None
            tools = doc.get("tools")
            return {**doc, "tools": [_tool(t.get("function"), t.get("defer_loading")) for t in tools]} \
                if isinstance(tools, list) and tools else {**doc, "tools": None}
        if api is Api.MESSAGES:
            return _from_messages(doc, merge_inline_system)
        if api is Api.RESPONSES:
            return _from_responses(doc)
    except (Unrenderable, KeyError, TypeError, AttributeError, IndexError):
        return None
    return None


def _text_blocks(blocks: Any) -> str | None:
    """``_extract_system_text``: a system block's text without Claude Code's billing header."""
    if isinstance(blocks, str):
        return None if blocks.startswith(BILLING_HEADER) else blocks
    if not isinstance(blocks, list):
        raise Unrenderable("system")
    parts = [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _from_messages(doc: dict, merge_inline_system: bool) -> dict:
    """``AnthropicServingMessages.to_chat_completion_request``."""
    messages = doc.get("messages")
    if not isinstance(messages, list):
        raise Unrenderable("messages")
    out: list[dict] = []
    system: list[str] = []
    top = doc.get("system")
    if isinstance(top, str) and top:
        system.append(top)
    elif isinstance(top, list):
        system += [b["text"] for b in top if isinstance(b, dict) and b.get("type") == "text" and b.get("text")
                   and not b["text"].startswith(BILLING_HEADER)]
    if merge_inline_system:
        system += [t for m in messages if m.get("role") == "system" for t in [_text_blocks(m.get("content"))] if t]
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for m in messages:
        role = m["role"]
        if role == "system":
            if not merge_inline_system and (t := _text_blocks(m.get("content"))):
                out.append({"role": "system", "content": t})
            continue
        msg: dict[str, Any] = {"role": role}
        content = m.get("content")
        if isinstance(content, str):
            msg["content"] = content
        elif isinstance(content, list):
            parts: list[dict] = []
            calls: list[dict] = []
            reasoning: list[str] = []
            for b in content:
                kind = b.get("type")
                if kind == "text":
                    if b.get("text"):
                        parts.append({"type": "text", "text": b["text"]})
                elif kind == "thinking":
                    if b.get("thinking") is not None:
                        reasoning.append(b["thinking"])
                elif kind == "tool_use":
                    if not b.get("id"):
                        raise Unrenderable("tool_use without id")  # vLLM names it by the clock
                    calls.append({"id": b["id"], "type": "function", "function": {
                        "name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
                elif kind == "tool_result":
                    if role == "user":
                        out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "",
                                    "content": _tool_result_text(b.get("content"))})
                    else:
                        parts.append({"type": "text", "text": f"Tool result: {b.get('content') or ''}"})
                elif kind in ("redacted_thinking", "tool_reference", "tool_addition", "tool_removal"):
                    if kind in ("tool_addition", "tool_removal"):
                        raise Unrenderable("tool changes")
                else:
                    raise Unrenderable(kind)  # images, documents: the engine adds what is not text
            if reasoning:
                msg["reasoning"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            if parts:
                msg["content"] = parts[0]["text"] if len(parts) == 1 else parts
        else:
            raise Unrenderable("content")
        if not (role == "user" and "content" not in msg):
            out.append(msg)
    tools = doc.get("tools")
    chat_tools = [_tool({**t, "parameters": t.get("input_schema")}) for t in tools] \
        if isinstance(tools, list) and tools else None
    return {"messages": out, "tools": chat_tools, "chat_template_kwargs": doc.get("chat_template_kwargs")}


def _tool(f: Any, defer: Any = None) -> dict:
    """A tool as vLLM hands it to the template (``ChatCompletionToolsParam.model_dump()``): its function's fields
    in the model's order, the unset optional ones left out, ``description`` and ``parameters`` always there."""
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise Unrenderable("tool")
    fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    if f.get("strict") is not None:
        fn["strict"] = f["strict"]
    if (d := f.get("defer_loading") if f.get("defer_loading") is not None else defer) is not None:
        fn["defer_loading"] = d
    out: dict[str, Any] = {"type": "function", "function": fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for item in content:
            if isinstance(item, dict) and item.get("type") not in ("text", "tool_reference", None):
                raise Unrenderable("tool result media")
            if isinstance(item, dict) and item.get("type") == "tool_reference":
                raise Unrenderable("tool reference")
        return "\n".join(item.get("text", "") for item in content if isinstance(item,
                                                                                dict) and item.get("type") == "text")
    return ""


def _from_responses(doc: dict) -> dict:
    """``construct_input_messages`` for a Responses request that carries its whole conversation."""
    if doc.get("previous_response_id") or doc.get("conversation"):
        raise Unrenderable("stored history")
    messages: list[dict] = []
    if doc.get("instructions"):
        messages.append({"role": "system", "content": doc["instructions"]})
    inp = doc.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            m = _response_item(item, messages[-1] if messages and messages[-1].get("role") == "assistant" else None)
            if m is not None:
                messages.append(m)
    else:
        raise Unrenderable("input")
    tools = None
    if isinstance(doc.get("tools"), list) and doc["tools"]:
        if any(t.get("type") != "function" for t in doc["tools"]):
            raise Unrenderable("built-in tools")
        tools = [_tool(t) for t in doc["tools"]]
    last = inp[-1] if isinstance(inp, list) and inp else None
    cont = isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") \
        and last.get("status") in ("in_progress", "incomplete")
    return {"messages": messages, "tools": tools, "chat_template_kwargs": doc.get("chat_template_kwargs"),
            "add_generation_prompt": not cont, "continue_final_message": cont}


def _response_item(item: dict, prev_assistant: dict | None) -> dict | None:
    """``_construct_message_from_response_item``: None when the item joined the assistant message before it."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        name = item["name"]
        if kind == "function_call" and item.get("namespace"):
            raise Unrenderable("namespaced tool")
        args = item.get("arguments") if kind == "function_call" else \
            json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        call = {"id": item["call_id"], "function": {"name": name, "arguments": args}, "type": "function"}
        if prev_assistant is not None:
            prev_assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise Unrenderable("encrypted reasoning")
        content, summary = item.get("content") or [], item.get("summary") or []
        text = content[0]["text"] if content else summary[0]["text"] if summary else ""
        if prev_assistant is not None and prev_assistant.get("reasoning") is None:
            prev_assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else content[0].get("text") if isinstance(content,
                                                                                             list) and content \
            else None
        if text is not None:
            if prev_assistant is not None and prev_assistant.get("content") is None:
                prev_assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return item
    raise Unrenderable(str(kind))


# -- what vLLM does to chat messages before the template sees them (renderers/chat_utils.py) --

_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content\b)|for\s+\w+\s+in\s+content\b")


def content_format(template: str) -> str:
    """``_detect_content_format``, in the form templates take: "openai" (content as a list of parts) when the
    template loops over a message's content, else "string" (parts joined with newlines)."""
    return "openai" if _CONTENT_LOOP.search(template) else "string"


def _strip_billing(parts: list) -> list:
    """``_strip_claude_code_billing_header``: a system text part that starts with the header loses its first line."""
    out = []
    for p in parts:
        text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(p)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def conversation(messages: list, fmt: str, developer_role: bool) -> list[dict]:
    """``parse_chat_messages`` for text-only messages, then ``_postprocess_messages``: each message's text parts
    as the template's content format wants them, assistant tool calls with their arguments as objects, tool
    results as one string; "developer" as "system" where the template has no developer role."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unrenderable("message")
        role, content = m["role"], m.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise Unrenderable("content")
        if role == "system":
            parts = _strip_billing(parts)
        texts = []
        for p in parts:
            if isinstance(p, str):
                texts.append(p)
                continue
            kind = p.get("type", "text") if isinstance(p, dict) else None
            if kind not in TEXT_PARTS:
                raise Unrenderable("not text")
            t = p.get("text") if kind != "refusal" else p.get("refusal")
            if t is None:
                continue
            texts.append(t)
        msg: dict[str, Any] = {"role": role,
                               "content": [{"type": "text", "text": t} for t in texts] if fmt == "openai"
                               else "\n".join(texts)}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = [_call(c) for c in m["tool_calls"]]
                if not msg["tool_calls"]:
                    del msg["tool_calls"]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _consolidate([{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                            if m["role"] == "developer" else m for m in out])
    return out


def _consolidate(conv: list[dict]) -> list[dict]:
    """``_consolidate_system_messages``: system messages after the first place become one, at the front."""
    texts: list = []
    rest: list[dict] = []
    needed = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        needed = needed or i > 0 or bool(texts)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c
                           if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if needed else conv


def _call(c: Any) -> dict:
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
        raise Unrenderable("tool call")
    f = dict(c["function"])
    args = f.get("arguments")
    if args:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        f["arguments"] = args if isinstance(args, dict) else {}
    else:
        f["arguments"] = {}
    return {**c, "function": f}
