"""Render a GGUF chat template (`tokenizer.chat_template`) the way llama.cpp's --jinja path does.

llama.cpp renders with its own Jinja engine (common/jinja) fed by common/chat.cpp; this module
reproduces what that pair does for plain chat (no tools) with jinja2:

* lexer options: trim_blocks and lstrip_blocks on, the template's trailing newline kept;
* variables: messages, bos_token, eos_token, enable_thinking, add_generation_prompt (only when
  true: llama.cpp leaves it undefined otherwise), datetime and date_string, plus any extra kwargs;
* helpers: raise_exception, strftime_now (local time), and a tojson that, like llama.cpp's, keeps
  key order and non-ASCII text and escapes no HTML;
* message fixes applied before rendering: each message is reduced to role and string content
  (text parts joined by newlines), "developer" becomes "system", and when the template ignores a
  system message it is merged into the next message;
* after rendering, a leading BOS / trailing EOS is dropped when the tokenizer adds it anyway.

The template comes from a file we do not trust, so it runs in jinja2's immutable sandbox.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# llama.cpp's fallback (CHATML_TEMPLATE_SRC) for models without a template; callers opt in to it.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)

# Fields of a message that llama.cpp passes on to the template when they are non-empty strings.
OPTIONAL_MESSAGE_FIELDS = ("reasoning_content", "name", "tool_call_id")


class ChatTemplateError(ValueError):
    """The template is missing, does not parse, raises, or cannot render these messages."""


class TemplateRaised(Exception):
    """raise_exception() was called from inside a template."""


def _raise_exception(message: str):
    raise TemplateRaised(f"Jinja Exception: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    if separators is None:
        separators = (", " if indent is None else ",", ": ")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=tuple(separators),
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


_ENV = _environment()


def _compile(template: str) -> jinja2.Template:
    if not template:
        raise ChatTemplateError("the model has no chat template (tokenizer.chat_template is empty or missing)")
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from None


def _render(compiled: jinja2.Template, context: Mapping) -> str:
    try:
        return compiled.render(**context)
    except TemplateRaised as exc:
        raise ChatTemplateError(f"chat template refused the messages: {exc}") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None


def _content_text(content) -> str:
    """String content as is; typed parts joined like llama.cpp does for string-only templates."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"]
        return "\n".join(texts)
    raise ChatTemplateError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """What common_chat_msg::to_json_oaicompat hands the template: role, content, optional extras."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role'")
        normal = {"role": message["role"], "content": _content_text(message.get("content"))}
        normal.update({k: message[k] for k in OPTIONAL_MESSAGE_FIELDS if isinstance(message.get(k), str) and message[k]})
        if normal["role"] == "developer":
            normal["role"] = "system"
        out.append(normal)
    return out


class _WatchedMessage(dict):
    """A message that notes whether the template read its content (llama.cpp's probe tracks use)."""
    content_read = False

    def __getitem__(self, key):
        if key == "content":
            self.content_read = True
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key == "content":
            self.content_read = True
        return super().get(key, default)


def supports_system_role(compiled: jinja2.Template) -> bool:
    """llama.cpp's capability probe: render [system, user] and see whether the system text was used."""
    system = _WatchedMessage(role="system", content="System message")
    messages = [system, {"role": "user", "content": "User message"}]
    try:
        compiled.render(messages=messages, bos_token="", eos_token="", add_generation_prompt=True, tools=[])
    except Exception:  # noqa: BLE001 - llama.cpp ignores failures while probing
        pass
    return system.content_read


def _merge_system_into_next(messages: list[dict]) -> list[dict]:
    """workaround::system_message_not_supported."""
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        return []
    merged = dict(messages[1], content=messages[0]["content"] + "\n" + messages[1]["content"])
    return [merged, *messages[2:]]


def apply_chat_template(template: str, messages: list[dict], *, bos_token: str, eos_token: str,
                        add_generation_prompt: bool = True, enable_thinking: bool = True,
                        extra_context: Mapping | None = None, vocab_adds_bos: bool = False,
                        vocab_adds_eos: bool = False) -> str:
    """The prompt text for `messages` (dicts with "role" and "content").

    `extra_context` plays the part of chat_template_kwargs. `vocab_adds_bos` / `vocab_adds_eos`
    are the GGUF's tokenizer.ggml.add_bos_token / add_eos_token: when set, a BOS the template
    printed at the start (an EOS at the end) is dropped so the tokenizer does not double it."""
    compiled = _compile(template)
    normal = normalize_messages(messages)
    if not supports_system_role(compiled):
        normal = _merge_system_into_next(normal)
    now = datetime.datetime.now()
    context = {
        "messages": normal,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "enable_thinking": enable_thinking,
        "datetime": now.strftime("%b %d %Y"),
        "date_string": now.strftime("%d %b %Y"),
        **(extra_context or {}),
    }
    if add_generation_prompt:
        context["add_generation_prompt"] = True
    prompt = _render(compiled, context)
    if vocab_adds_bos and bos_token and prompt.startswith(bos_token):
        prompt = prompt[len(bos_token):]
    if vocab_adds_eos and eos_token and prompt.endswith(eos_token):
        prompt = prompt[:-len(eos_token)]
    return prompt
