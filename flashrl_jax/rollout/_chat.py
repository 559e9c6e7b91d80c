"""Chat templates: a model directory's Jinja2 template rendered the way `transformers` renders it.

Why our own renderer: the server must turn OpenAI `messages` (and `tools`) into exactly the prompt
the model was trained on, without importing transformers at serving time. transformers renders
`tokenizer_config.json`'s `chat_template` (or a `chat_template.jinja` file) in an immutable Jinja2
sandbox with `trim_blocks` and `lstrip_blocks`, the loop-control extension, a `tojson` filter that
keeps non-ASCII text, the globals `raise_exception` and `strftime_now`, and the tokenizer's special
tokens as variables; it passes `messages`, `tools`, `add_generation_prompt` and any extra
`chat_template_kwargs`. This module does the same (checked against `apply_chat_template` in a test).

Tool calls the model emits are read back with the Hermes convention the project's own template
uses, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import uuid
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
  """The template refused the conversation (its `raise_exception`), or failed to render."""


class _Generation(Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): body only."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _raise(message: str):
  raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[_Generation, loopcontrols])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise
_ENV.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)


class ChatTemplate:
  """One compiled chat template plus the special tokens it may refer to."""

  def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
    try:
      self._template = _ENV.from_string(source)
    except jinja2.TemplateError as e:
      raise TemplateError(f"the chat template does not compile: {e}") from None
    self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}

  @classmethod
  def from_model_dir(cls, path: str) -> ChatTemplate | None:
    """The template of a model directory (`chat_template.jinja`, else `tokenizer_config.json`)."""
    config: dict[str, Any] = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(config_file):
      with open(config_file) as f:
        config = json.load(f)
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
      value = config.get(key)
      special[key] = value.get("content") if isinstance(value, dict) else value
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
      with open(jinja_file) as f:
        return cls(f.read(), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
      source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return cls(source, special) if isinstance(source, str) else None

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, **kwargs: Any) -> str:
    """The prompt text for `messages` (OpenAI format), prepared as transformers prepares them.

    Keys whose value is null are dropped (OpenAI clients send `content: null` beside `tool_calls`,
    and templates test for a missing key), reasoning is aliased under every name templates read,
    and `continue_final_message` ends the prompt right after the last message's text, so the model
    continues it instead of starting a new one.
    """
    chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
    if continue_final_message:
      chat[-1] = _tag_final(dict(chat[-1]))
    try:
      text = self._template.render(messages=chat, tools=list(tools) if tools else None,
                                   documents=None, add_generation_prompt=add_generation_prompt,
                                   **{**self._special, **kwargs})
    except TemplateError:
      raise
    except jinja2.TemplateError as e:
      raise TemplateError(f"the chat template failed on these messages: {e}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as e:
      raise TemplateError(f"the chat template failed on these messages: {e!r}") from None
    if continue_final_message:
      at = text.rfind(_CONTINUE_TAG.strip())
      if at < 0:
        raise TemplateError("continue_final_message: the template dropped the final message.")
      keeps_space = text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
      text = text[:at] if keeps_space else text[:at].rstrip()
    return text


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
  reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
  if reasoning is None:
    return message
  return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final(message: dict[str, Any]) -> dict[str, Any]:
  """Marks where the final message's text ends, to cut the rendered prompt there."""
  content = message.get("content")
  if isinstance(content, str):
    message["content"] = content + _CONTINUE_TAG
    return message
  if isinstance(content, list):
    parts = [dict(p) if isinstance(p, dict) else p for p in content]
    for part in reversed(parts):
      if isinstance(part, dict) and "text" in part:
        part["text"] = str(part["text"]) + _CONTINUE_TAG
        message["content"] = parts
        return message
  raise TemplateError("continue_final_message: the final message has no text to continue.")


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
  """(content outside the calls or None, OpenAI `tool_calls`) from Hermes-style output.

  A block that is not a JSON object with a string `name` is not a call: it stays in the content
  (the model's text is never dropped because it looks almost like a call).
  """
  calls, kept, last = [], [], 0
  for match in _TOOL_CALL.finditer(text):
    try:
      obj = json.loads(match.group(1))
    except ValueError:
      continue
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      continue
    arguments = obj.get("arguments", {})
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": obj["name"],
                               "arguments": arguments if isinstance(arguments, str)
                               else json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[last:match.start()])
    last = match.end()
  kept.append(text[last:])
  content = "".join(kept).strip() if calls else text
  return (content or None) if calls else content, calls
