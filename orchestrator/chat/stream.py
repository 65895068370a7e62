"""A chat answer as it is generated: the text so far re-parsed after each piece, the differences
sent as OpenAI `delta` objects (llama-server's task_result_state::update_chat_msg), tool-call ids
made once per call, as llama-server makes them (32 random letters and digits)."""

from __future__ import annotations

import secrets
import string

from orchestrator.chat.formats import ChatParams
from orchestrator.chat.parse import Message, diff

_ID_ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase


def tool_call_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


class ChatStream:
    def __init__(self, params: ChatParams):
        self.params = params
        self.text = ""
        self.ids: list[str] = []
        self.message = Message()  # a prefilled assistant message is streamed back too, as llama-server does

    def _update(self, partial: bool) -> list[dict]:
        new = self.params.parse(self.text, partial)  # ParseError: the finished text does not fit the format
        for i, call in enumerate(new.tool_calls):
            if len(self.ids) <= i:
                self.ids.append(call.id or tool_call_id())
            call.id = self.ids[i]
        if new == Message():
            return []
        deltas = diff(self.message, new)
        self.message = new
        return deltas

    def push(self, text: str) -> list[dict]:
        """Adds generated text; the deltas to stream now."""
        self.text += text
        return self._update(partial=True)

    def finish(self, text: str = "") -> list[dict]:
        """The last text; the final parse (ParseError if the finished text does not fit the format)."""
        self.text += text
        return self._update(partial=False)
