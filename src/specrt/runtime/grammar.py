"""A request's grammar: which tokens may come next as its output and its drafts advance.

llguidance (the `structured` extra; benchmarks/grammar_engines.py says why it was chosen)
compiles JSON Schema, regular expressions and Lark grammars against the bundle's tokenizer and
answers, at any position, with the tokens allowed next (a mask), the tokens the grammar forces
(drafted for free) and how many of a list of tokens it accepts. Speculation walks ahead of what
is emitted: the draft model drafts within the grammar, the verify call's rows are masked
position by position, and what the target rejects is rolled back. `Grammar` is that walk: a
matcher, the position it stands at, and the masks met along the current path (a position's
mask depends only on the tokens before it, so the mask computed for a draft step serves the
verify row at the same place).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

KINDS = ("json_schema", "json_object", "regex", "lark", "choice")
# JSON as models write it inline and as OpenAI's structured outputs read: `{"a": 1, "b": [2, 3]}`.
# A fixed layout lets the grammar force keys, quotes and separators (drafted for free); a schema
# may choose another with llguidance's own "x-guidance" key.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Structure:
    """What an output must match: kind is one of KINDS; value is the JSON schema (a dict), the
    regular expression or Lark grammar (text), or the choices (a list of strings);
    json_object takes no value (any JSON object)."""

    kind: str
    value: object = None

    def grammar(self) -> str:
        """The grammar in llguidance's form; a SpecrtError for a malformed value."""
        ll = _llguidance().LLMatcher
        if self.kind == "json_schema":
            if not isinstance(self.value, dict):
                raise _error(f"a JSON schema must be an object, got {type(self.value).__name__}")
            return ll.grammar_from_json_schema(self.value, defaults=JSON_LAYOUT)
        if self.kind == "json_object":
            return ll.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind in ("regex", "lark") and not isinstance(self.value, str):
            raise _error(f"a {self.kind} grammar must be text, got {type(self.value).__name__}")
        if self.kind == "regex":
            return ll.grammar_from_regex(self.value)
        if self.kind == "lark":  # GBNF (llama.cpp's form) is taken too, converted to Lark
            return ll.grammar_from_lark(_llguidance().gbnf_to_lark.any_to_lark(self.value))
        if self.kind == "choice":
            choices = self.value
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise _error("choice must be a non-empty list of non-empty strings")
            return ll.grammar_from_regex("|".join(re.escape(c) for c in choices))
        raise _error(f"unknown structure {self.kind!r}; choose from {', '.join(KINDS)}")


def _error(message: str, param: str = "structure") -> SpecrtError:
    return SpecrtError(message, param=param)


def _llguidance():
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.numpy
    except ImportError as err:
        raise SpecrtError(
            "structured output needs the grammar engine: pip install 'specrt[structured]'",
            param="structure",
        ) from err
    return llguidance


class Grammars:
    """Compiles a request's structure against one tokenizer. Reading the vocabulary takes about
    a second, so it happens once, at the first constrained request, whichever thread asks."""

    def __init__(self, tokenizer_file: Path, vocab: int, eos: Sequence[int]):
        self.tokenizer_file, self.vocab, self.eos = tokenizer_file, vocab, list(eos)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                text = self.tokenizer_file.read_text()
                ll = _llguidance()
                self._tokenizer = ll.LLTokenizer(text, n_vocab=self.vocab, eos_token=self.eos)
            return self._tokenizer

    @functools.cache  # noqa: B019 (one per runtime, kept as long as it)
    def _vocabulary(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_file))

    def literal(self, text: str) -> str:
        """text in a Lark grammar: a special token of the vocabulary by its id (the engine
        matches those as tokens, never as the bytes of their name), anything else as a
        string."""
        token = self._vocabulary().token_to_id(text)
        if token is not None and self.tokenizer.is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(text)

    def compile(self, structure: Structure) -> Grammar:
        grammar = structure.grammar()
        matcher = _llguidance().LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise _error(self._fault(structure, matcher.get_error()))
        return Grammar(matcher, self.vocab)

    def _fault(self, structure: Structure, error: str) -> str:
        """The engine's complaint, with the JSON schema path at fault where there is one."""
        error = error.strip().splitlines()[0] if error.strip() else "invalid grammar"
        if structure.kind != "json_schema":
            return f"invalid {structure.kind}: {error}"
        path = self._schema_fault(structure.value)
        where = f" at {path}" if path else ""
        return f"invalid or unsupported JSON schema{where}: {error}"

    def _schema_fault(self, schema: dict) -> str | None:
        """The deepest subschema that fails alone (with the root's definitions beside it), as a
        JSON pointer: the engine names the problem, not where it is."""
        ll = _llguidance().LLMatcher
        definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        fault = None
        for path, sub in _subschemas(schema):
            grammar = ll.grammar_from_json_schema({**definitions, **sub}, defaults=JSON_LAYOUT)
            if ll(self.tokenizer, grammar).is_error():
                fault = path if fault is None or path.startswith(fault) else fault
        return fault


def _subschemas(schema: dict, path: str = "#") -> Iterator[tuple[str, dict]]:
    """Every subschema under schema, depth first, with its JSON pointer."""
    yield path, schema
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
            value, dict
        ):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield from _subschemas(sub, f"{where}/{name}")
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    yield from _subschemas(sub, f"{where}/{i}")
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            yield from _subschemas(value, where)


class Grammar:
    """One request's matcher. Its position is the caller's (`Constraints`' cursor): masks are
    kept by position for the path walked until the walk leaves that path (`forget_after`), so
    drafting and then verifying the same tokens computes each mask once."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self._masks: dict[int, np.ndarray] = {}  # allowed tokens at positions on the path
        self._bits = _llguidance().numpy.allocate_token_bitmask(1, vocab)

    def allowed(self, position: int) -> np.ndarray:
        """Which tokens may come next at position, where the matcher stands (bool, one per
        logit); EOS where the grammar may end."""
        mask = self._masks.get(position)
        if mask is None:
            _llguidance().numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
            bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
            mask = bits[: self.vocab].view(bool)
            self._masks[position] = mask
        return mask

    def copy(self) -> Grammar:
        """The same grammar, standing where this one stands, walked on its own (another choice
        of one request: compiled once)."""
        return Grammar(self.matcher.deep_copy(), self.vocab)

    def consume(self, token: int) -> None:
        """Take a token the grammar allows (a caller checks with `accepts` or the mask)."""
        if not self.matcher.consume_token(token):
            raise SpecrtError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def forget_after(self, position: int) -> None:
        """The walk leaves the path at position: the masks past it are not the new path's."""
        self._masks = {p: m for p, m in self._masks.items() if p <= position}

    def rollback(self, count: int) -> None:
        """Undo the last count tokens consumed."""
        if count:
            self.matcher.rollback(count)

    def settle(self, position: int) -> None:
        """The output up to position is final: forget the masks before it."""
        self._masks = {p: m for p, m in self._masks.items() if p >= position}

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the grammar allows from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (keys, quotes, braces)."""
        return list(self.matcher.compute_ff_tokens())

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow."""
        return self.matcher.is_stopped()


def load_structure(kind: str, source: str) -> Structure:
    """A structure from a file (the CLI's --json-schema FILE, --grammar FILE, --regex)."""
    path = Path(source)
    if not path.is_file():
        raise SpecrtError(f"no such file: {source}", param=kind)
    text = path.read_text()
    if kind != "json_schema":
        return Structure(kind, text)
    try:
        return Structure(kind, json.loads(text))
    except json.JSONDecodeError as err:
        raise SpecrtError(f"{source} is not JSON: {err}", param=kind) from err
