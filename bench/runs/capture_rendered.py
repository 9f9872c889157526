"""``python -m bench fixtures-rendered``: how many prompt tokens a real vLLM 0.32 counts for each shape of request
the brain renders itself (issue 45: chat, Anthropic Messages and Responses, with tool calls, tool results,
reasoning, developer and inline system messages), into ``tests/fixtures/vllm-0.32/rendered-prompts.json``.

Two engines in turn: the tiny model's own template (it loops over content parts: vLLM hands it parts) and
``tests/fixtures/chat-templates/chatml-tools.jinja`` given with --chat-template (laid out as Qwen2.5's: tools and
tool calls written with ``tojson``; content as one string), both with a tool-call parser so that requests may
carry tools. tests/brain/test_engine_render.py holds the brain's rendering against these counts.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.runs.capture_vllm import engine_model, send
from extproc.tools.stack import real_vllm

OUT = real_vllm.REPO / "tests" / "fixtures" / "vllm-0.32" / "rendered-prompts.json"
TOOLS_TEMPLATE = real_vllm.REPO / "tests" / "fixtures" / "chat-templates" / "chatml-tools.jinja"
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}

READ = {"name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CASES = [
    ("chat", "chat", {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user",
                                                                                     "content": "hi"}]}),
    ("chat-parts", "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b c"}]}]}),
    ("chat-tools", "chat", {"tools": [{"type": "function", "function": {**READ, "strict": True}}], "messages": [
        {"role": "user", "content": "read x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "l1"}, {"type": "text",
                                                                                            "text": "l2"}]},
        {"role": "user", "content": "and now?"}]}),
    ("chat-developer", "chat", {"messages": [{"role": "developer", "content": "be kind"}, {"role": "user",
                                                                                           "content": "hi"}]}),
    ("messages", "messages", {"system": "You are terse.", "messages": [{"role": "user", "content": "hi"}]}),
    ("messages-blocks", "messages", {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "sys A"},
                   {"type": "text", "text": "sys B"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}),
    ("messages-tools", "messages", {"system": "sys", "tools": [{"name": READ["name"],
                                                                "description": READ["description"],
                                                              "input_schema": READ["parameters"]}], "messages": [
        {"role": "user", "content": "read x"},
        {"role": "assistant", "content": [{"type": "text", "text": "sure"},
                                          {"type": "tool_use", "id": "tu1", "name": "read_file",
                                           "input": {"path": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                      "content": [{"type": "text", "text": "l1"}, {"type": "text", "text": "l2"}]},
                                     {"type": "text", "text": "now what"}]}]}),
    ("messages-thinking", "messages", {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "answer"}]},
        {"role": "user", "content": "more"}]}),
    ("messages-inline-system", "messages", {"system": "top", "messages": [
        {"role": "user", "content": "q"}, {"role": "system", "content": "reminder"}, {"role": "user",
                                                                                      "content": "q2"}]}),
    ("responses", "responses", {"instructions": "be terse", "input": "hi", "store": False}),
    ("responses-items", "responses", {"tools": [{"type": "function", **READ}], "store": False, "input": [
        {"role": "user", "content": "read x"},
        {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{\"path\": \"x\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "l1\nl2"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"},
                                                        {"type": "input_text", "text": "please"}]}]}),
    ("responses-reasoning", "responses", {"store": False, "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"role": "user", "content": "q2"}]}),
]


def prompt_tokens(usage: dict) -> int:
    """The engine's prompt tokens in any of the three APIs' usage."""
    if "prompt_tokens" in usage:  # chat completions
        return usage["prompt_tokens"]
    if "input_tokens_details" in usage:  # Responses: input_tokens is the whole prompt
        return usage["input_tokens"]
    # Anthropic's input_tokens leaves out what was read from and written to the cache
    return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + \
        (usage.get("cache_creation_input_tokens") or 0)


def main(argv: list[str] | None = None) -> int:
    model = engine_model(argv, __doc__)
    if model is None:
        return 1
    parser = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    out = []
    for template, extra in (("model", parser), (TOOLS_TEMPLATE.name, (*parser, "--chat-template",
                                                                      str(TOOLS_TEMPLATE)))):
        with tempfile.TemporaryDirectory(prefix="warmroute-capture-") as d:
            proc, port = real_vllm.start_vllm("vllm", Path(d), real_vllm.VllmOptions(lora=(), extra=extra))
            try:
                for name, api, body in CASES:
                    doc = {"model": model, "temperature": 0, **body,
                           **({"max_output_tokens": 16} if api == "responses" else {"max_tokens": 1})}
                    status, answer = send(f"http://127.0.0.1:{port}", PATHS[api], doc, model)
                    assert status == 200, (name, status)
                    out.append({"case": name, "api": api, "template": template, "body": doc,
                                "prompt_tokens": prompt_tokens(json.loads(answer)["usage"])})
            finally:
                proc.stop()
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}: {len(out)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
