"""The chat template, written twice: in Python (`bouncer.tokenizer.chat_segments`, what the gateway
and `bouncer engine` count) and in Jinja (`data/chat_template.jinja`, what the tiny vLLM model of
the real-engine tests renders). The two must give the same text for everything the engine reads:
plain messages, content parts, tools, tool calls (their arguments as vLLM hands them over,
parsed), so that the gateway's prompt count is vLLM's."""

from __future__ import annotations

import json
from importlib import resources

import jinja2
import pytest

from bouncer.tokenizer import render_chat, tool_arguments

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CASES = {
    "plain": ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], None),
    "parts": ([{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
              None),
    "tools": ([{"role": "user", "content": "weather in Zürich?"}], TOOLS),
    "tool round trip": ([
        {"role": "user", "content": "weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C, rain"}], TOOLS),
}


def _as_vllm_hands_them(messages: list[dict]) -> list[dict]:
    """Messages as vLLM gives a text model's template: text parts joined by newlines, tool-call
    arguments parsed to objects (an invalid string to an empty one)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": tool_arguments(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_jinja_template_renders_what_the_gateway_counts(case):
    messages, tools = CASES[case]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers compiles chat templates
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string((resources.files("bouncer") / "data" / "chat_template.jinja").read_text())
    jinja = template.render(messages=_as_vllm_hands_them(messages), tools=tools, add_generation_prompt=True)
    assert jinja == render_chat(messages, tools)
