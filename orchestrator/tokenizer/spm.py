"""SentencePiece-style vocabularies (tokenizer.ggml.model "llama"), as llm_tokenizer_spm_session does it.

Text is split into UTF-8 characters and the adjacent pair whose joined text is the best-scoring token is
merged until no pair is a token; characters with no token fall back to <0xNN> byte tokens. Spaces are
spelled "▁" (SPACE_ESCAPE) in the vocabulary.
"""

from __future__ import annotations

import heapq

from orchestrator.tokenizer.errors import TokenizerError
from orchestrator.tokenizer.unicode import UTF8_LEN

SPACE_ESCAPE = "▁".encode()


class SpmTokenizer:
    """The token texts and scores of one vocabulary."""

    def __init__(self, id_of_text: dict[bytes, int], scores: list[float]):
        self.id_of_text, self.scores = id_of_text, scores

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize: merge the best-scoring adjacent pair until none is a token."""
        starts, sizes, offset = [], [], 0
        while offset < len(text):
            size = min(UTF8_LEN[text[offset] >> 4], len(text) - offset)
            starts.append(offset)
            sizes.append(size)
            offset += size
        count = len(starts)
        nxt = list(range(1, count)) + [-1] if count else []
        prv = list(range(-1, count - 1))
        queue: list[tuple[float, int, int, int]] = []
        rev_merge: dict[bytes, tuple[int, int]] = {}

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            joined = text[starts[left]:starts[left] + sizes[left] + sizes[right]]
            token = self.id_of_text.get(joined)
            if token is None:
                return
            heapq.heappush(queue, (-self.scores[token], left, right, len(joined)))
            rev_merge[joined] = (left, right)

        for i in range(1, count):
            push(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not sizes[left] or not sizes[right] or sizes[left] + sizes[right] != size:
                continue
            sizes[left] += sizes[right]
            sizes[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        def resegment(symbol: int) -> None:
            piece = text[starts[symbol]:starts[symbol] + sizes[symbol]]
            token = self.id_of_text.get(piece)
            if token is not None:
                out.append(token)
            elif piece in rev_merge:
                for half in rev_merge[piece]:
                    resegment(half)
            else:
                out.extend(self._byte_token(b) for b in piece)

        symbol = 0 if count else -1
        while symbol != -1:
            resegment(symbol)
            symbol = nxt[symbol]

    def _byte_token(self, byte: int) -> int:
        token = self.id_of_text.get(b"<0x%02X>" % byte)
        if token is None:
            token = self.id_of_text.get(bytes([byte]) if byte else b"")
        if token is None:
            raise TokenizerError(f"SPM vocabulary has no token for byte 0x{byte:02X} (llama.cpp fails here too)")
        return token
