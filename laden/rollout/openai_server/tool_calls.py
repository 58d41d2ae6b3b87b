"""Tool calls in a model's text, in its family's format, as OpenAI `tool_calls`.

The format is chosen once per tokenizer from its chat template: a template that renders tool calls as
`<tool_call>{json}</tool_call>` (Qwen 2.5 / Qwen 3, Hermes, and the models trained on their templates)
gets the `hermes` parser; any other template gets none (`tool_call_format` returns None and the
endpoint says so once): the model's text then comes back as the message's content, unparsed. A
`tool_call_parser` setting (AReaL's `rollout.agent.tool_call_parser`: `qwen`, `qwen25`, `qwen3`,
`hermes`) names the same format explicitly.

Parsing follows what vLLM's and SGLang's Hermes parsers return: every complete
`<tool_call>...</tool_call>` block whose body is a JSON object with a `name` becomes one call (its
`arguments` re-serialised as a JSON string), the text before the first block is the content (None when
empty), and a block that is not valid JSON leaves the whole text as content, with no calls.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES = "hermes"
PARSER_ALIASES = {"hermes": HERMES, "qwen": HERMES, "qwen25": HERMES, "qwen3": HERMES, "qwen2_5": HERMES}
"""AReaL's (SGLang's) `tool_call_parser` names that mean the `<tool_call>{json}</tool_call>` format."""
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call_format(tokenizer: Any, parser: str | None = None) -> str | None:
    """The tool-call format of `tokenizer`'s model: `parser` when given (`ValueError` for an unknown one),
    else `hermes` when its chat template renders `<tool_call>` blocks, else None (no tool parsing)."""
    if parser not in (None, "", "auto"):
        key = str(parser).lower()
        if key not in PARSER_ALIASES:
            raise ValueError(
                f"tool_call_parser={parser!r} is not a format laden parses; use one of "
                f"{sorted(PARSER_ALIASES)} (the <tool_call>{{json}}</tool_call> format) or 'auto'"
            )
        return PARSER_ALIASES[key]
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: any of them
        template = " ".join(str(t) for t in template.values())
    return HERMES if "<tool_call>" in str(template) else None


def parse_tool_calls(text: str, fmt: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a completion's text in format `fmt` (see the module docstring)."""
    if fmt != HERMES or "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _BLOCK.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
        })  # fmt: skip
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls
