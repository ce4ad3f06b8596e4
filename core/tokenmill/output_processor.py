"""Turning engine token deltas into text deltas: one pass, beside the tokenizer.

Runs in the caller's process offline and in the front end when serving, never
in the engine. Each token is detokenized once (``IncrementalDetokenizer``), and
each logprob entry's text is decoded once. Stop strings are matched here and
only here: text that could still be the start of a stop string is held back
until it is known not to be one, so what a completion has released
(``CompletionOutput.text``, and each ``CompletionDelta.text``) never needs to
be taken back. When a stop string matches, the text is cut before it and the
caller aborts that completion in the engine (``ProcessedStep.to_abort``).

With logprobs, each token's share of the text is tracked too (``TextToken``):
a token is released with the text it produced, so the logprobs an API returns
line up with the returned text, in every delta and in the whole completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.messages import EngineCoreOutput, TokenLogprobs, completion_request_id
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput, TextToken
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class CompletionDelta:
    """What one completion gained from one engine output."""

    request_id: str  # the id the caller gave
    index: int  # which of the n completions
    text: str  # newly released text
    text_offset: int  # where ``text`` starts in the completion's text
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # set on the completion's last delta
    #: With logprobs: the tokens whose text ``text`` holds (they concatenate to it).
    text_tokens: list[TextToken] | None = None


@dataclass
class _CompletionState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    #: Decoded text not yet released: it could be the start of a stop string.
    held: str = ""
    #: With logprobs: tokens whose text is not yet wholly released, oldest first.
    pending: list[TextToken] = field(default_factory=list)
    #: Released characters not yet covered by a released TextToken.
    unassigned: int = 0


@dataclass
class ProcessedStep:
    #: Requests (by the id the caller gave) that gained text or finished this step.
    updated: list[RequestOutput] = field(default_factory=list)
    #: Per completion that changed, in engine output order: its delta.
    deltas: list[CompletionDelta] = field(default_factory=list)
    #: Engine ids of completions to abort because a stop string ended them.
    to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Keeps one ``RequestOutput`` per request and updates it from engine outputs. Called once per step."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, tuple[RequestOutput, SamplingParams]] = {}
        self._completions: dict[str, _CompletionState] = {}  # by engine request id

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestOutput:
        output = RequestOutput(request_id, prompt, prompt_token_ids)
        self._requests[request_id] = (output, params)
        return output

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def process(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedStep:
        step = ProcessedStep()
        updated: dict[str, RequestOutput] = {}
        # Requests the engine says are done: all n completions, or fewer when aborted before the others forked.
        done: set[str] = set()
        for engine_output in engine_outputs:
            found = self._completion(engine_output)
            if found is None:
                continue
            request, params, state = found
            if engine_output.request_finished:
                done.add(request.request_id)
            if state.output.finished:
                continue  # already ended by a stop string; the engine's abort echo adds nothing
            delta = self._apply(engine_output, params, state, step)
            if delta is not None:
                step.deltas.append(delta)
            updated[request.request_id] = request
        for request_id, request in updated.items():
            complete = len(request.outputs) == self._requests[request_id][1].n or request_id in done
            if complete and all(completion.finished for completion in request.outputs):
                request.finished = True
                del self._requests[request_id]
                for completion in request.outputs:
                    self._completions.pop(completion_request_id(request_id, completion.index), None)
            step.updated.append(request)
        return step

    def _completion(
        self, engine_output: EngineCoreOutput
    ) -> tuple[RequestOutput, SamplingParams, _CompletionState] | None:
        request_id = engine_output.parent_id or engine_output.request_id
        if request_id not in self._requests:
            return None  # finished already (a stop string ended it; this is the abort's echo)
        request, params = self._requests[request_id]
        state = self._completions.get(engine_output.request_id)
        if state is None:
            completion = CompletionOutput(
                index=engine_output.index,
                text="",
                token_ids=[],
                logprobs=[] if params.logprobs is not None else None,
                text_tokens=[] if params.logprobs is not None else None,
            )
            request.outputs.append(completion)
            request.outputs.sort(key=lambda c: c.index)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            state = self._completions[engine_output.request_id] = _CompletionState(completion, detokenizer)
        request.num_cached_tokens = engine_output.num_cached_tokens
        if engine_output.prompt_logprobs is not None and request.prompt_logprobs is None:
            request.prompt_logprobs = [None, *map(self._logprobs, engine_output.prompt_logprobs)]
        return request, params, state

    def _apply(
        self, engine_output: EngineCoreOutput, params: SamplingParams, state: _CompletionState, step: ProcessedStep
    ) -> CompletionDelta | None:
        """Add one engine output to a completion; returns what it released, or None if nothing changed."""
        completion = state.output
        text_offset = len(completion.text)
        token_ids: list[int] = []
        logprobs: list[dict[int, Logprob]] | None = [] if completion.logprobs is not None else None
        for position, token_id in enumerate(engine_output.new_token_ids):
            completion.token_ids.append(token_id)
            token_ids.append(token_id)
            text = state.detokenizer.push([token_id])
            if logprobs is not None and completion.logprobs is not None and engine_output.new_logprobs:
                entry = self._logprobs(engine_output.new_logprobs[position])
                completion.logprobs.append(entry)
                logprobs.append(entry)
                state.pending.append(TextToken(token_id, text, entry))
            if text and self._add_text(state, text, params):
                step.to_abort.append(engine_output.request_id)
                break
        if not completion.finished and engine_output.finish_reason is not None:
            tail = state.detokenizer.finish()
            if tail and state.pending:  # bytes that never formed a character: theirs, as U+FFFD
                first_empty = next((i for i, token in enumerate(state.pending) if not token.text), 0)
                token = state.pending[first_empty]
                state.pending[first_empty] = TextToken(token.token_id, token.text + tail, token.logprobs)
            if not (tail and self._add_text(state, tail, params)):
                completion.text += state.held  # no stop string can complete now
                state.held = ""
                completion.finish_reason = engine_output.finish_reason
                last = completion.token_ids[-1] if completion.token_ids else None
                if engine_output.finish_reason == "stop" and last in params.stop_token_ids:
                    completion.stop_reason = last
        released = completion.text[text_offset:]
        if not released and not token_ids and not completion.finished:
            return None
        text_tokens = None
        if completion.text_tokens is not None:
            text_tokens = _release_tokens(state, len(released))
            completion.text_tokens.extend(text_tokens)
        return CompletionDelta(
            request_id=engine_output.parent_id or engine_output.request_id,
            index=completion.index,
            text=released,
            text_offset=text_offset,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            text_tokens=text_tokens,
        )

    @staticmethod
    def _add_text(state: _CompletionState, text: str, params: SamplingParams) -> bool:
        """Add newly decoded text: release what cannot start a stop string, hold the rest. If a stop string
        now occurs, release the text before it, finish the completion and return True."""
        candidate = state.held + text
        output = state.output
        if params.stop:
            # Released text never ends in the start of a stop string, so a match lies within ``candidate``.
            matches = [(i, s) for s in params.stop if (i := candidate.find(s)) != -1]
            if matches:
                cut, stop = min(matches)
                output.text += candidate[:cut]
                state.held = ""
                output.finish_reason = "stop"
                output.stop_reason = stop
                return True
        keep = _stop_prefix_length(candidate, params.stop)
        if keep and output.text_tokens is not None:
            keep = len(candidate) - _token_boundary(state.pending, len(candidate), len(candidate) - keep)
        output.text += candidate[: len(candidate) - keep]
        state.held = candidate[len(candidate) - keep :]
        return False

    def prompt_tokens(self, output: RequestOutput) -> list[TextToken]:
        """The prompt as TextTokens (what ``echo`` returns): each token's share of the prompt's text and, with
        ``prompt_logprobs``, its logprobs (the first token has none: nothing precedes it)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        logprobs = output.prompt_logprobs or []
        tokens = []
        for position, token_id in enumerate(output.prompt_token_ids):
            entry = logprobs[position] if position < len(logprobs) else None
            tokens.append(TextToken(token_id, detokenizer.push([token_id]), entry or {}))
        tail = detokenizer.finish()
        if tail and tokens:
            last = tokens[-1]
            tokens[-1] = TextToken(last.token_id, last.text + tail, last.logprobs)
        return tokens

    def _logprobs(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The token and its alternatives, each decoded on its own; the alternatives' ranks follow their order."""
        decode = self.tokenizer.decode
        rank = token_logprobs.rank or None
        entries = {token_logprobs.token_id: Logprob(token_logprobs.logprob, decode([token_logprobs.token_id]), rank)}
        for position, (token_id, logprob) in enumerate(
            zip(token_logprobs.top_token_ids, token_logprobs.top_logprobs, strict=True), start=1
        ):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, decode([token_id]), position if rank else None)
        return entries


def _token_boundary(pending: list[TextToken], candidate_length: int, limit: int) -> int:
    """The last token boundary at or before ``limit`` in the text not yet released (of ``candidate_length``
    characters, the end of the pending tokens' text), so that held text never splits a token: each delta's
    text then has whole tokens and its logprobs line up with it."""
    position = candidate_length - sum(len(token.text) for token in pending)  # where the pending text starts
    boundary = 0
    for token in pending:
        position += len(token.text)
        if position > limit:
            break
        boundary = max(position, 0)
    return boundary


def _release_tokens(state: _CompletionState, num_released: int) -> list[TextToken]:
    """The pending tokens whose text the ``num_released`` newly released characters complete.

    A token with no text of its own (the first bytes of a character) goes with the next token that has text.
    When the completion has finished, what is left is not in the text: the token a stop string cut keeps only
    its released part, and the rest (EOS, stop token ids, tokens of the stop string) are dropped.
    """
    state.unassigned += num_released
    released: list[TextToken] = []
    while state.pending:
        end = next((i for i, token in enumerate(state.pending) if token.text), None)
        if end is None or len(state.pending[end].text) > state.unassigned:
            break
        state.unassigned -= len(state.pending[end].text)
        released += state.pending[: end + 1]
        del state.pending[: end + 1]
    if state.output.finished:
        if state.unassigned and state.pending:
            token = next(token for token in state.pending if token.text)  # unassigned text came from one
            cut = state.pending.index(token)
            released += state.pending[:cut]
            released.append(TextToken(token.token_id, token.text[: state.unassigned], token.logprobs))
        state.pending.clear()
        state.unassigned = 0
    return released


def _stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of some stop string (0 if none)."""
    longest = max((len(s) - 1 for s in stops), default=0)
    for length in range(min(longest, len(text)), 0, -1):
        end = text[-length:]
        if any(stop.startswith(end) for stop in stops):
            return length
    return 0
