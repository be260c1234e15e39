"""Which grammar engine constrains specrt's output: llguidance, xgrammar and outlines-core,
measured on the bundle's own vocabulary (Qwen2.5: 151,665 tokens, 151,936 logits).

What the runtime needs of an engine, per request and per round: a token mask at every position
it drafts or verifies (K + 1 a round), advancing over K drafted tokens and rolling back the
rejected ones, the tokens a grammar forces (drafted for free), JSON Schema as clients send it,
and nothing that pulls torch into the server. Each is measured here:

    python benchmarks/grammar_engines.py --tokenizer BUNDLE/target/tokenizer.json \
        --out benchmarks/results/cpu-grammar-engines

The walk: a valid invoice is tokenized and fed token by token; at every position the engine
computes the mask (timed), then consumes the token. Rollback: consume 8 tokens, roll back 8.
Coverage: each schema of `COVERAGE` must compile and accept a valid instance. An engine that
is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from specrt.files import write_result  # noqa: E402
from specrt.machine import describe, label  # noqa: E402

INVOICE = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string"},
        "date": {"type": "string", "format": "date"},
        "vendor": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vat_id": {"type": "string"}},
            "required": ["name", "vat_id"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "total": {"type": "number"},
    },
    "required": ["invoice_number", "date", "vendor", "lines", "currency", "total"],
    "additionalProperties": False,
}
INVOICE_INSTANCE = {
    "invoice_number": "INV-2024-0193",
    "date": "2024-03-18",
    "vendor": {"name": "Nordwind Logistics GmbH", "vat_id": "DE811907980"},
    "lines": [
        {"description": "Pallet storage, March", "quantity": 12, "unit_price": 14.5},
        {"description": "Handling fee", "quantity": 1, "unit_price": 89.0},
    ],
    "currency": "EUR",
    "total": 263.0,
}

# (feature, schema, a valid instance): what clients' schemas use (Pydantic's output included)
COVERAGE = [
    ("enum and const", {"enum": ["a", "b"]}, "a"),
    ("string pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12"),
    ("string length", {"type": "string", "minLength": 2, "maxLength": 4}, "abc"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2024-03-18T10:00:00Z"),
    ("integer bounds", {"type": "integer", "minimum": 3, "maximum": 99}, 42),
    ("number", {"type": "number"}, -1.5e3),
    ("array bounds", {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, [1, 2]),
    ("anyOf / nullable", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    (
        "$defs and $ref (Pydantic)",
        {
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "type": "object",
            "properties": {"p": {"$ref": "#/$defs/P"}},
            "required": ["p"],
        },
        {"p": {"x": 1}},
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "Node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                    },
                    "required": ["v", "next"],
                }
            },
            "$ref": "#/$defs/Node",
        },
        {"v": 1, "next": {"v": 2, "next": None}},
    ),
    (
        "optional properties",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
        {"b": "x"},
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1},
    ),
    ("the invoice", INVOICE, INVOICE_INSTANCE),
]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (Qwen2.5's tokenizer uses it)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class LLGuidance:
    name = "llguidance"
    module = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import llguidance
        import llguidance.numpy as lln

        self.ll, self.lln = llguidance, lln
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.mask = lln.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill_mask(self, m) -> None:
        self.lln.fill_next_token_bitmask(m, self.mask, 0)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def forced(self, m) -> list[int]:
        return m.compute_ff_tokens()


class XGrammar:
    name = "xgrammar"
    module = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        path = Path("/tmp/specrt-grammar-engines-tokenizer.json")
        path.write_text(tokenizer_json)
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema))
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=32)

    def fill_mask(self, m) -> None:
        m.fill_next_token_bitmask(self.mask)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def forced(self, m) -> list[int]:
        return []  # it forces a string (find_jump_forward_string), not tokens


class OutlinesCore:
    name = "outlines-core"
    module = "outlines_core"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import outlines_core

        self.oc = outlines_core
        model = json.loads(tokenizer_json)
        decode = byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        pieces = {**model["model"]["vocab"]}
        pieces.update({t["content"]: t["id"] for t in model.get("added_tokens", [])})
        for piece, token in pieces.items():
            if token == eos:
                continue
            raw = bytes(decode[c] for c in piece) if all(c in decode for c in piece) else None
            tokens.setdefault(raw or piece.encode(), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab = vocab
        self.mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill_mask(self, m) -> None:
        m.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def consume(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, m, n: int) -> None:
        m.rollback_state(n)

    def forced(self, m) -> list[int]:
        return []


ENGINES = (LLGuidance, XGrammar, OutlinesCore)


def pulls_torch(module: str) -> bool | None:
    """Whether importing the engine imports torch (None: not installed)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if done.returncode else done.stdout.strip() == "True"


def walk_tokens(engine, tokenizer, schema: dict, instance) -> list[int] | None:
    """The instance's tokens in a form the engine accepts (spaced or compact JSON)."""
    for separators in ((", ", ": "), (",", ":")):
        text = json.dumps(instance, separators=separators)
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        matcher = engine.compile(schema)
        if all(engine.consume(matcher, t) for t in tokens):
            return tokens
    return None


def measure(engine_type, tokenizer_json: str, tokenizer, vocab: int, eos: int) -> dict:
    start = time.perf_counter()
    engine = engine_type(tokenizer_json, vocab, eos)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile(INVOICE)
    compile_s = time.perf_counter() - start
    tokens = walk_tokens(engine, tokenizer, INVOICE, INVOICE_INSTANCE)
    row: dict = {"setup_s": setup, "compile_invoice_s": compile_s}
    if tokens is None:
        return {**row, "walk": "the engine rejected every form of the valid invoice"}
    matcher, masks, forced = engine.compile(INVOICE), [], 0
    for token in tokens:
        t0 = time.perf_counter()
        engine.fill_mask(matcher)
        masks.append(time.perf_counter() - t0)
        forced += bool(engine.forced(matcher))
        engine.consume(matcher, token)
    matcher, rollbacks = engine.compile(INVOICE), []
    for start in range(0, len(tokens) - 8, 8):
        for token in tokens[start : start + 8]:
            engine.consume(matcher, token)
        t0 = time.perf_counter()
        engine.rollback(matcher, 8)
        for token in tokens[start : start + 8]:
            engine.consume(matcher, token)
        rollbacks.append(time.perf_counter() - t0)
    return {
        **row,
        "walk_tokens": len(tokens),
        "mask_us_mean": 1e6 * statistics.mean(masks),
        "mask_us_p95": 1e6 * float(np.percentile(masks, 95)),
        "rollback_8_and_readvance_us": 1e6 * statistics.mean(rollbacks),
        "positions_with_forced_tokens": forced,
        "coverage": coverage(engine, tokenizer),
    }


def coverage(engine, tokenizer) -> dict[str, str]:
    found = {}
    for feature, schema, instance in COVERAGE:
        try:
            ok = walk_tokens(engine, tokenizer, schema, instance) is not None
            found[feature] = "yes" if ok else "compiles, rejects a valid instance"
        except Exception as err:  # an engine's refusal, whatever its type
            found[feature] = f"no: {str(err).splitlines()[0][:80]}"
    return found


def wheels(package: str) -> dict[str, bool]:
    """Whether pip finds a binary wheel for CPython 3.10, 3.11, 3.12 on this platform."""
    found = {}
    for version in ("3.10", "3.11", "3.12"):
        args = ["download", "--no-deps", "--only-binary=:all:", "--python-version", version]
        done = subprocess.run(
            [sys.executable, "-m", "pip", *args, "-d", "/tmp/specrt-wheels", "-q", package],
            capture_output=True,
        )
        found[version] = done.returncode == 0
    return found


def markdown(result: dict) -> str:
    lines = [
        "# Grammar engines on the Qwen2.5 vocabulary",
        "",
        f"Machine: {label(result['machine'])}. Command: `{result['command']}`",
        "",
        "| | " + " | ".join(result["engines"]) + " |",
        "|---|" + "---|" * len(result["engines"]),
    ]
    rows = [
        ("imports torch", "imports_torch"),
        ("wheels 3.10/3.11/3.12", "wheels"),
        ("tokenizer setup (s)", "setup_s"),
        ("compile the invoice schema (s)", "compile_invoice_s"),
        ("mask per position, mean (µs)", "mask_us_mean"),
        ("mask per position, p95 (µs)", "mask_us_p95"),
        ("roll back 8 and re-advance (µs)", "rollback_8_and_readvance_us"),
        ("positions with forced tokens", "positions_with_forced_tokens"),
    ]
    for name, key in rows:
        cells = [_cell(r.get(key)) for r in result["engines"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "JSON Schema coverage (compiles and accepts a valid instance):", ""]
    lines += ["| feature | " + " | ".join(result["engines"]) + " |"]
    lines += ["|---|" + "---|" * len(result["engines"])]
    for feature, _, _ in COVERAGE:
        cells = [r.get("coverage", {}).get(feature, "-") for r in result["engines"].values()]
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    if isinstance(value, dict):
        return "/".join("yes" if v else "no" for v in value.values())
    return "-" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a Qwen2.5 tokenizer.json")
    parser.add_argument("--vocab", type=int, default=151936, help="logits per row")
    parser.add_argument("--eos", type=int, default=151645)
    parser.add_argument("--out", default="benchmarks/results/cpu-grammar-engines")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    text = Path(args.tokenizer).read_text()
    tokenizer = Tokenizer.from_str(text)
    engines = {}
    for engine_type in ENGINES:
        torch = pulls_torch(engine_type.module)
        row: dict = {"imports_torch": torch, "wheels": wheels(engine_type.name)}
        if torch is not None:
            row.update(measure(engine_type, text, tokenizer, args.vocab, args.eos))
        engines[engine_type.name] = row
        print(engine_type.name, json.dumps(row, indent=1), flush=True)
    result = {
        "kind": "grammar_engines",
        "machine": describe(),
        "command": "python benchmarks/grammar_engines.py " + " ".join(sys.argv[1:]),
        "engines": engines,
    }
    write_result(Path(args.out), result, markdown(result))


if __name__ == "__main__":
    main()
