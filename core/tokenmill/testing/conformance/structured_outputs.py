"""``check_structured_outputs_backend``: a structured-output backend and its grammars against the constraints'
own languages, on the kit's tiny tokenizer.

Each constraint the check compiles accepts a short list of strings, written out here, so the tokens a backend may
allow after any prefix are known exactly: those whose text continues the prefix towards one of the strings, and
EOS once the prefix is one of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from tokenmill.testing.conformance._util import calling, conformance_check, fail, tiny_tokenizer
from tokenmill.tokenizer import Tokenizer

_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}

#: name -> (the constraint, every string it accepts, the one the check walks). ASCII only: the check reads a
#: token's text with ``Tokenizer.decode``, exact for the tiny tokenizer's ASCII tokens (a lone byte past ASCII
#: decodes to U+FFFD, which none of these strings holds).
CONSTRAINTS: dict[str, tuple[StructuredOutputsParams, tuple[str, ...], str]] = {
    "JSON schema (no whitespace)": (
        StructuredOutputsParams(json=_SCHEMA, disable_any_whitespace=True),
        tuple(f'{{"color":"{color}","ok":{ok}}}' for color in ("red", "green") for ok in ("true", "false")),
        '{"color":"green","ok":false}',
    ),
    "regex": (
        StructuredOutputsParams(regex=r"[ab]{1,3}@(x|yz)"),
        tuple(
            "".join(letters) + "@" + end
            for count in (1, 2, 3)
            for letters in itertools.product("ab", repeat=count)
            for end in ("x", "yz")
        ),
        "bab@yz",
    ),
    # "no" is a prefix of "none": after it, EOS and the rest of "none" are both allowed.
    "choice": (StructuredOutputsParams(choice=["yes", "no", "none", "maybe"]), ("yes", "no", "none", "maybe"), "none"),
}
#: Constraints that can never compile: each must raise ``ValueError`` (from ``validate`` too, when it checks).
INVALID_CONSTRAINTS: dict[str, StructuredOutputsParams] = {
    "a schema of an unknown type": StructuredOutputsParams(json={"type": "strin"}),
    "an unbalanced regex": StructuredOutputsParams(regex="a(b"),
}
#: Logits wider than the tokenizer, as models pad them: ids past the tokenizer's are never allowed.
_PADDED_IDS = 24


@conformance_check
def check_structured_outputs_backend(
    backend: type[StructuredOutputBackend] | Callable[[Tokenizer, int], StructuredOutputBackend],
) -> None:
    """Build the backend over the kit's tiny byte-level tokenizer (512 ids, EOS ``<|im_end|>``) for logits 24 ids
    wider, and check it against ``CONSTRAINTS``, a JSON schema (no whitespace), a regex and a choice, each
    compiled once (the three at once, in threads):

    - walking a valid text token by token (then EOS), ``fill_bitmask`` allows no token but those that continue
      the text towards a string the constraint accepts (so never a special token or a padded id), and EOS once
      the text is complete; it allows the text's next token and, wherever the text is complete, EOS (it may
      refuse other ways of splitting the same text: llguidance does); it writes its whole row (the same whether
      the row held all ones or zeros) and no other row;
    - ``validate_tokens`` counts the valid run of tokens, stops at a refused one, and leaves the state as it was;
      ``accept_tokens`` takes each valid token and returns False for a refused one;
    - ``is_terminated`` once EOS is accepted, never while more than EOS may follow (it may be where only EOS
      may: llguidance stops there);
    - ``rollback`` (past EOS, halfway, to the start, twice in a row) restores the mask of the position it lands
      on, and the walk goes on from there;
    - a new matcher of a compiled grammar starts at the start while another one has advanced;
    - ``INVALID_CONSTRAINTS`` raise ``ValueError`` from ``compile_grammar``, and from ``validate`` when the
      backend ``validates`` (which passes the valid ones).

    :param backend: the class, built as the engine builds it (``backend(tokenizer, vocab_size)``), or any callable
        taking those two (``functools.partial(MyBackend, options=...)``).
    :raises AssertionError: naming the constraint, the position and the tokens that differ.
    """
    tokenizer = tiny_tokenizer()
    vocab_size = tokenizer.vocab_size + _PADDED_IDS
    with calling("building the backend"):
        candidate = backend(tokenizer, vocab_size)
    name = type(candidate).__name__
    texts = _token_texts(tokenizer)

    for case, params in INVALID_CONSTRAINTS.items():
        if candidate.validates:
            _raises_value_error(f"{name}.validate({case}: {params!r})", candidate.validate, params)
        _raises_value_error(f"{name}.compile_grammar({case}: {params!r})", candidate.compile_grammar, params)

    with ThreadPoolExecutor(max_workers=len(CONSTRAINTS)) as pool:
        futures = {case: pool.submit(candidate.compile_grammar, params) for case, (params, _, _) in CONSTRAINTS.items()}
    for case, (params, language, walk) in CONSTRAINTS.items():
        where = f"{name} on the {case} {params.spec}"
        with calling(f"{where}: compile_grammar"):
            compiled = futures[case].result()
        if candidate.validates:
            with calling(f"{where}: validate (of a valid constraint)"):
                candidate.validate(params)
        token_ids = [*tokenizer.encode(walk, add_special_tokens=False), tokenizer.eos_token_ids[0]]
        matcher = _Matcher(candidate, compiled, where, tokenizer, vocab_size, texts, language, token_ids)
        matcher.independent()  # first: a matcher that shares its state with others fails here, saying so
        matcher.walk(matcher.new())
        matcher.refuses()
        matcher.rolls_back()


def _token_texts(tokenizer: Tokenizer) -> list[str | None]:
    """Each id's text; None for special tokens."""
    special = tokenizer.special_token_ids
    return [None if t in special else tokenizer.decode([t]) for t in range(tokenizer.vocab_size)]


def _raises_value_error(
    what: str, call: Callable[[StructuredOutputsParams], Any], params: StructuredOutputsParams
) -> None:
    try:
        call(params)
    except ValueError:
        return
    except Exception as exc:
        fail(f"{what} raised {type(exc).__name__}: {exc}; raise ValueError naming the problem")
    fail(f"{what} returned; a constraint that cannot compile must raise ValueError naming the problem")


@dataclass
class _Matcher:
    """Drives matchers of one compiled constraint along one valid text and compares what they allow with the
    constraint's language."""

    backend: StructuredOutputBackend
    compiled: Any
    where: str
    tokenizer: Tokenizer
    vocab_size: int
    #: Each id's text; None for special tokens.
    texts: list[str | None]
    #: Every string the constraint accepts.
    language: Sequence[str]
    #: The valid text's tokens, then EOS.
    token_ids: list[int]
    #: What the first matcher allowed at each position of ``token_ids``: later matchers must allow the same.
    masks: list[set[int]] = field(default_factory=list)

    def new(self) -> StructuredOutputGrammar:
        with calling(f"{self.where}: grammar"):
            return self.backend.grammar(self.compiled)

    def at(self, position: int) -> str:
        return f"after {self.tokenizer.decode(self.token_ids[:position])!r}"

    def possible(self, position: int) -> set[int]:
        """The ids the constraint allows after the first ``position`` tokens: a backend allows these or fewer
        (llguidance, for one, refuses a token that splits text it forces where a longer token covers it)."""
        prefix = self.tokenizer.decode(self.token_ids[:position])
        allowed = {
            t
            for t, text in enumerate(self.texts)
            if text is not None and any(s.startswith(prefix + text) for s in self.language)
        }
        return allowed | {self.token_ids[-1]} if prefix in self.language else allowed

    def refused(self, position: int) -> int:
        """A token the constraint refuses after the first ``position`` tokens (another one at each position)."""
        possible = self.possible(position)
        refused = [t for t, text in enumerate(self.texts) if text is not None and t not in possible]
        return refused[(97 * position) % len(refused)]

    def mask(self, grammar: StructuredOutputGrammar, at: str) -> set[int]:
        """The ids ``grammar`` allows next, read from row 1 of a 3-row bitmask filled with ones, then with zeros:
        both must give the same row, and rows 0 and 2 must keep their fill."""
        words = (self.vocab_size + 31) // 32
        rows = []
        for fill in (-1, 0):
            bitmask = torch.full((3, words), fill, dtype=torch.int32)  # [3, ceil(vocab_size / 32)]
            with calling(f"{self.where}: fill_bitmask {at}"):
                grammar.fill_bitmask(bitmask, 1)
            if not (bool((bitmask[0] == fill).all()) and bool((bitmask[2] == fill).all())):
                fail(f"{self.where}: fill_bitmask {at} wrote rows other than the one it was given")
            rows.append(bitmask[1].clone())
        if not torch.equal(rows[0], rows[1]):
            fail(f"{self.where}: fill_bitmask {at} left bits of a row that held ones or zeros as they were; "
                 "it must write every word of its row")  # fmt: skip
        bits = (rows[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
        return set(bits.flatten()[: self.vocab_size].nonzero().flatten().tolist())

    def compare(self, grammar: StructuredOutputGrammar, position: int, at: str) -> None:
        """What ``grammar`` allows after the first ``position`` tokens: none but what the constraint allows, the
        valid text's next token, and what the first matcher allowed there."""
        allowed, possible = self.mask(grammar, at), self.possible(position)
        if allowed - possible:
            fail(f"{self.where}: fill_bitmask {at} allows tokens the constraint refuses: "
                 f"{self.describe(allowed - possible)}")  # fmt: skip
        following = self.token_ids[position]
        if following not in allowed:
            what = "EOS after a complete text" if position == len(self.token_ids) - 1 else "the valid text's next token"
            fail(f"{self.where}: fill_bitmask {at} refuses {what}, {self.describe([following])}")
        eos = self.token_ids[-1]
        if eos in possible and eos not in allowed:
            fail(f"{self.where}: fill_bitmask {at} refuses EOS, though the text is complete")
        if position < len(self.masks) and allowed != self.masks[position]:
            fail(f"{self.where}: fill_bitmask {at} differs from what the first matcher allowed at the same position: "
                 f"{self.describe(allowed ^ self.masks[position])}")  # fmt: skip
        if position == len(self.masks):
            self.masks.append(allowed)

    def describe(self, token_ids: Sequence[int] | set[int]) -> str:
        ordered = sorted(token_ids) if isinstance(token_ids, set) else token_ids
        shown = [f"{t} ({self._name(t)})" for t in ordered]
        return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")

    def _name(self, token_id: int) -> str:
        if token_id >= len(self.texts):
            return "a padded id"
        text = self.texts[token_id]
        return repr(text) if text is not None else f"special {self.tokenizer.convert_ids_to_tokens([token_id])[0]}"

    def stopped(self, grammar: StructuredOutputGrammar, position: int, at: str) -> bool:
        """Whether ``grammar`` is terminated after the first ``position`` tokens: it must be once EOS is accepted,
        may be where nothing but EOS can follow (llguidance stops there, and refuses the EOS), and must not be
        anywhere else."""
        with calling(f"{self.where}: is_terminated {at}"):
            terminated = grammar.is_terminated()
        if position == len(self.token_ids) and terminated is not True:
            fail(f"{self.where}: is_terminated {at} is {terminated!r}; expected True once EOS is accepted")
        if terminated and position < len(self.token_ids) and self.possible(position) != {self.token_ids[-1]}:
            fail(f"{self.where}: is_terminated {at} is True, but the constraint allows more than EOS there")
        return bool(terminated)

    def walk(self, grammar: StructuredOutputGrammar, start: int = 0, how: str = "") -> None:
        """From ``start`` on, each token of the valid text then EOS, one at a time: masks, ``validate_tokens``
        (which changes no state) and ``accept_tokens``; as the engine does, nothing once it is terminated."""
        token_ids = self.token_ids
        for position in range(start, len(token_ids)):
            at, rest, token_id = self.at(position) + how, token_ids[position:], token_ids[position]
            if self.stopped(grammar, position, at):
                return
            self.compare(grammar, position, at)
            refused = self.refused(position)
            runs = {"the valid tokens that follow": (rest, len(rest)), "a refused token": ([refused], 0)}
            if len(rest) > 1:
                runs["the next token, then one refused after it"] = ([token_id, self.refused(position + 1)], 1)
            for run, (tokens, expected_count) in runs.items():
                with calling(f"{self.where}: validate_tokens {at}"):
                    count = grammar.validate_tokens(tokens)
                if count != expected_count:
                    stop = f" (it stops at {self.describe(tokens[count : count + 1])})" if count < len(tokens) else ""
                    fail(f"{self.where}: validate_tokens {at} gave {count}{stop} for {run}, {self.describe(tokens)}; "
                         f"expected {expected_count}")  # fmt: skip
            self.compare(grammar, position, f"{at}, after validate_tokens (which must leave the state as it was)")
            with calling(f"{self.where}: accept_tokens {at}"):
                accepted = grammar.accept_tokens([token_id])
            if accepted is not True:
                fail(f"{self.where}: accept_tokens {at} returned {accepted!r} for {self.describe([token_id])}, "
                     "which the constraint allows")  # fmt: skip
        self.stopped(grammar, len(token_ids), f"after the valid text and EOS{how}")

    def refuses(self) -> None:
        """``accept_tokens`` returns False for a refused token, alone and after valid ones (each on a fresh
        matcher: one that refused a token is left unusable)."""
        for position in (0, len(self.token_ids) // 2):
            refused = self.refused(position)
            with calling(f"{self.where}: accept_tokens"):
                accepted = self.new().accept_tokens([*self.token_ids[:position], refused])
            if accepted is not False:
                fail(f"{self.where}: accept_tokens returned {accepted!r} for the valid tokens {self.at(position)[6:]} "
                     f"then the refused {self.describe([refused])}; expected False")  # fmt: skip

    def rolls_back(self) -> None:
        """Accept the valid text and EOS in one call (as drafts are), roll back (past EOS, halfway, to the start)
        and walk on from where it lands; and two rollbacks in a row."""
        end = len(self.token_ids)
        for backs in ((0,), (1,), (2,), (end // 2,), (end,), (1, end - 2)):
            grammar, position = self.new(), end
            with calling(f"{self.where}: accept_tokens"):
                if not grammar.accept_tokens(self.token_ids):
                    fail(f"{self.where}: accept_tokens refused the whole valid text and EOS in one call")
            for back in backs:
                with calling(f"{self.where}: rollback({back})"):
                    grammar.rollback(back)
                position -= back
            how = f" (reached by accepting it all, then {' then '.join(f'rollback({back})' for back in backs)})"
            self.walk(grammar, position, how)

    def independent(self) -> None:
        """A matcher advanced halfway leaves a new one of the same compiled grammar at the start."""
        with calling(f"{self.where}: accept_tokens"):
            self.new().accept_tokens(self.token_ids[: len(self.token_ids) // 2])
        self.compare(self.new(), 0, "of a new matcher while another of the same compiled grammar has advanced")
