"""Chat, Anthropic Messages and Responses requests rendered as vLLM 0.32 renders them (issue 45): the brain's token
count of each shape (tool calls and results, reasoning, developer and inline system messages, content parts,
Claude Code's billing header) is the real engine's, recorded by ``python -m bench fixtures-rendered`` under two
templates: the tiny model's own (content as parts) and a Qwen2.5-style one that writes tools with ``tojson``
(content as one string)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.brain.engine_render import chat_request, content_format
from extproc.brain.engine_tokens import ChatTokens
from extproc.core.apis import Api

FIX = Path(__file__).resolve().parents[1] / "fixtures"
RECORDED = json.loads((FIX / "vllm-0.32" / "rendered-prompts.json").read_text())
TOKENS = {"model": ChatTokens(FIX / "tiny-llama-tokenizer"),
          "chatml-tools.jinja": ChatTokens(FIX / "tiny-llama-tokenizer",
                                           chat_template=FIX / "chat-templates" / "chatml-tools.jinja")}


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: f"{r['template']}-{r['case']}")
def test_each_shape_counts_the_tokens_the_engine_counted(rec):
    got = TOKENS[rec["template"]].tokens(rec["body"], None, Api(rec["api"]))
    assert got is not None and len(got) == rec["prompt_tokens"]


def test_the_two_templates_take_content_in_their_own_form():
    assert TOKENS["model"].format == "openai" and TOKENS["chatml-tools.jinja"].format == "string"
    assert content_format("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"


def test_a_tool_is_handed_over_with_vllm_s_fields_in_vllm_s_order():
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"parameters": {}, "type": "function", "name": "f"}}]}
    [tool] = chat_request(body, Api.CHAT)["tools"]
    assert json.dumps(tool) == '{"type": "function", "function": {"name": "f", "description": null, "parameters": {}}}'


def test_what_the_engine_adds_or_keeps_elsewhere_is_left_to_the_estimate():
    ct = TOKENS["model"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    assert ct.tokens({"messages": [{"role": "user", "content": [image]}]}, None, Api.MESSAGES) is None
    # a turn that follows a stored response: the engine prepends a conversation the brain never saw
    assert ct.tokens({"input": "more", "previous_response_id": "resp_1"}, None, Api.RESPONSES) is None
    assert ct.tokens({"input": [{"type": "reasoning", "encrypted_content": "..."}]}, None, Api.RESPONSES) is None
    assert ct.tokens({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
                     None, Api.MESSAGES) is None  # a tool call without an id: vLLM names it by its clock
    # a body of very many messages costs the event loop more than its bytes say: estimated past MAX_MESSAGES
    from extproc.brain.engine_render import MAX_MESSAGES

    many = [{"role": "user", "content": "x"}] * MAX_MESSAGES
    assert ct.tokens({"messages": many}) is not None
    assert ct.tokens({"messages": many + [{"role": "user", "content": "x"}]}) is None
    assert ct.tokens({"input": many + [{"role": "user", "content": "x"}]}, None, Api.RESPONSES) is None
