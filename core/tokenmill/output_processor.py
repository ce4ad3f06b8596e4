"""Turning engine token deltas into text: incremental detokenization and stop strings.

Runs beside the tokenizer (offline in the caller's process, when serving in
the front end), never in the engine. A stop string can span tokens, so text
is matched as it grows; when one matches, the text is cut before it and the
caller must abort the request in the engine (``ProcessedStep.to_abort``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.messages import EngineCoreOutput, TokenLogprobs, completion_request_id
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _CompletionState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    #: Text matched so far; a stop string is searched only where new text could complete one.
    full_text: str = ""


@dataclass
class ProcessedStep:
    #: Requests (by the id the caller gave) that gained text or finished this step.
    updated: list[RequestOutput] = field(default_factory=list)
    #: Engine request ids to abort because a stop string ended them.
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

    def process(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedStep:
        step = ProcessedStep()
        updated: dict[str, RequestOutput] = {}
        for engine_output in engine_outputs:
            found = self._completion(engine_output)
            if found is None:
                continue
            request, params, state = found
            completion = state.output
            if completion.finished:
                continue  # already ended by a stop string; the engine's abort echo adds nothing
            for position, token_id in enumerate(engine_output.new_token_ids):
                completion.token_ids.append(token_id)
                if completion.logprobs is not None and engine_output.new_logprobs:
                    completion.logprobs.append(self._logprobs(engine_output.new_logprobs[position]))
                delta = state.detokenizer.push([token_id])
                if delta and self._apply_stop_strings(state, delta, params):
                    step.to_abort.append(engine_output.request_id)
                    break
            if not completion.finished and engine_output.finish_reason is not None:
                self._finish_text(state, params)
                completion.finish_reason = engine_output.finish_reason
                last = completion.token_ids[-1] if completion.token_ids else None
                if engine_output.finish_reason == "stop" and last in params.stop_token_ids:
                    completion.stop_reason = last
            updated[request.request_id] = request
        for request_id, request in updated.items():
            if len(request.outputs) == self._expected_outputs(request_id) and request.finished:
                del self._requests[request_id]
                for completion in request.outputs:
                    self._completions.pop(completion_request_id(request_id, completion.index), None)
            step.updated.append(request)
        return step

    def _expected_outputs(self, request_id: str) -> int:
        return self._requests[request_id][1].n

    def _apply_stop_strings(self, state: _CompletionState, delta: str, params: SamplingParams) -> bool:
        """Append ``delta``; if a stop string now occurs, cut the text before it and finish. Returns True then."""
        previous = len(state.full_text)
        state.full_text += delta
        if params.stop:
            longest = max(len(s) for s in params.stop)
            search_from = max(0, previous - longest + 1)
            matches = [(i, s) for s in params.stop if (i := state.full_text.find(s, search_from)) != -1]
            if matches:
                cut, stop = min(matches)
                state.full_text = state.full_text[:cut]
                state.output.text = state.full_text
                state.output.finish_reason = "stop"
                state.output.stop_reason = stop
                return True
        state.output.text = state.full_text
        return False

    def _finish_text(self, state: _CompletionState, params: SamplingParams) -> None:
        tail = state.detokenizer.finish()
        if tail:
            self._apply_stop_strings(state, tail, params)

    def _logprobs(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        entries = {token_logprobs.token_id: token_logprobs.logprob}
        entries.update(zip(token_logprobs.top_token_ids, token_logprobs.top_logprobs, strict=True))
        return {token_id: Logprob(logprob, self.tokenizer.decode([token_id])) for token_id, logprob in entries.items()}
