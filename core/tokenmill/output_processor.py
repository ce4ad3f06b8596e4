"""Turning engine token deltas into text deltas: one pass, beside the tokenizer.

Runs in the caller's process offline and in the front end when serving, never
in the engine. Each token is detokenized once (``IncrementalDetokenizer``), and
each logprob entry's text is decoded once. Stop strings are matched here and
only here: text that could still be the start of a stop string is held back
until it is known not to be one, so what a completion has released
(``CompletionOutput.text``, and each ``CompletionDelta.text``) never needs to
be taken back. When a stop string matches, the text is cut before it and the
caller aborts that completion in the engine (``ProcessedStep.to_abort``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.messages import EngineCoreOutput, TokenLogprobs, completion_request_id
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
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


@dataclass
class _CompletionState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    #: Decoded text not yet released: it could be the start of a stop string.
    held: str = ""


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
            if complete and request.finished:
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
            )
            request.outputs.append(completion)
            request.outputs.sort(key=lambda c: c.index)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            state = self._completions[engine_output.request_id] = _CompletionState(completion, detokenizer)
        request.num_cached_tokens = engine_output.num_cached_tokens
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
            if logprobs is not None and completion.logprobs is not None and engine_output.new_logprobs:
                entry = self._logprobs(engine_output.new_logprobs[position])
                completion.logprobs.append(entry)
                logprobs.append(entry)
            text = state.detokenizer.push([token_id])
            if text and self._add_text(state, text, params):
                step.to_abort.append(engine_output.request_id)
                break
        if not completion.finished and engine_output.finish_reason is not None:
            tail = state.detokenizer.finish()
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
        return CompletionDelta(
            request_id=engine_output.parent_id or engine_output.request_id,
            index=completion.index,
            text=released,
            text_offset=text_offset,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
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
        output.text += candidate[: len(candidate) - keep]
        state.held = candidate[len(candidate) - keep :]
        return False

    def _logprobs(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        entries = {token_logprobs.token_id: token_logprobs.logprob}
        entries.update(zip(token_logprobs.top_token_ids, token_logprobs.top_logprobs, strict=True))
        return {token_id: Logprob(logprob, self.tokenizer.decode([token_id])) for token_id, logprob in entries.items()}


def _stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of some stop string (0 if none)."""
    longest = max((len(s) - 1 for s in stops), default=0)
    for length in range(min(longest, len(text)), 0, -1):
        end = text[-length:]
        if any(stop.startswith(end) for stop in stops):
            return length
    return 0
