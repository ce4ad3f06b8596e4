"""Streaming detokenization: token ids in, finished text deltas out.

Decoding each new token on its own is wrong in two ways. A character can be
split over several tokens (byte-level BPE pieces, or ``<0xE4>`` byte-fallback
tokens), so a lone token decodes to U+FFFD. And SentencePiece decoders drop
the leading space of the first token they see, so " world" would come out as
"world". We use the offset technique of vLLM instead: decode a window that
starts a few tokens back (``prefix_offset``) twice, once up to the last
emitted token (``read_offset``) and once to the end, and emit the difference.
While the window's text ends in U+FFFD the character is incomplete, so the
text is held back until a later token completes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenmill.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompt tokens kept as decoding context for the first generated tokens (vLLM uses 5).
NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a delta at a time.

    One instance per request, used by the detokenizer process once per step
    for that request. Not thread-safe. With ``prompt_token_ids`` the last few
    prompt tokens are used as context, so the first generated token keeps the
    leading space it has after the prompt; their text is never emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the ids from prefix_offset on are kept; older ones are never decoded again.
        prompt = list(prompt_token_ids or ())
        self._token_ids: list[int] = prompt[max(len(prompt) - NUM_PROMPT_CONTEXT_TOKENS, 0) :]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._parts: list[str] = []
        self._num_generated = 0

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes not included)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_generated_tokens(self) -> int:
        """How many token ids have been pushed."""
        return self._num_generated

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they finish (possibly "").

        Text ending in an incomplete UTF-8 sequence is held back until a later
        token completes it, so no delta ends in a partial character.
        """
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        self._num_generated += len(token_ids)
        return self._advance(flush=False)

    def finish(self) -> str:
        """Emit whatever is held back, even an incomplete character (as U+FFFD).

        Call once when the request ends. Returns "" when nothing was held.
        """
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset :]
        num_read = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:num_read], skip_special_tokens=self._skip_special_tokens)
        new_text = decode(window, skip_special_tokens=self._skip_special_tokens)
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            # Nothing new yet (a skipped special token), or a character still incomplete.
            return ""
        if not new_text.startswith(prefix_text):
            # Only with invalid UTF-8 from the model: a byte run that never became a character.
            logger.debug("detokenizer window changed its prefix: %r -> %r", prefix_text, new_text)
        delta = new_text[len(prefix_text) :]
        # The tokens just emitted become the next window's context; drop the older ones.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        if delta:
            self._parts.append(delta)
        return delta
