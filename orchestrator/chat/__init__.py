"""Chat: the GGUF's template rendered as llama.cpp renders it (`template`), the template families
and their parsers of generated text (`formats`, `parse`), and a request's chat fields (`apply`)."""

from orchestrator.chat.apply import apply, chat_request
from orchestrator.chat.formats import ChatParams, ChatRequest, Family, detect
from orchestrator.chat.parse import Message, ParseError, ToolCall, diff
from orchestrator.chat.stream import ChatStream
from orchestrator.chat.template import (CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, apply_chat_template,
                                        normalize_messages)

__all__ = ["CHATML_TEMPLATE", "ChatStream", "ChatParams", "ChatRequest", "ChatTemplate", "ChatTemplateError", "Family", "Message",
           "ParseError", "ToolCall", "apply", "apply_chat_template", "chat_request", "detect", "diff",
           "normalize_messages"]
