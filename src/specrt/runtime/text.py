"""Text in and out without transformers: the bundle's tokenizer.json, chat templates, streaming.

Chat templates are Jinja, rendered in a sandbox the way transformers renders them, so the
prompt a model sees through specrt is the one it was trained with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

from specrt.errors import SpecrtError

# A prompt of more than SCAN_FROM characters per token of its limit is counted a piece of
# SCAN_PIECE characters at a time, each cut where whitespace starts, and each cut may cost up to
# SLACK tokens the whole text would not have (a word split, a prefix space).
SCAN_FROM, SCAN_PIECE, SLACK = 4, 1 << 16, 8
WHITESPACE = re.compile(r"\s")


class PastLimit(Exception):
    """A prompt with more than `tokens` tokens, more than its limit: counted no further."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.tokens = tokens


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_template(path: Path) -> str:
    """A chat template file's Jinja text (`--chat-template`), refused here if it does not
    parse, rather than at the first chat request."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecrtError(f"--chat-template {path}: cannot read it ({err})") from err
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as err:
        raise SpecrtError(
            f"--chat-template {path}: not a Jinja template (line {err.lineno}: {err.message})"
        ) from err
    return text


class TextTokenizer:
    @classmethod
    def from_bundle(cls, bundle, chat_template: str | None = None) -> TextTokenizer:
        """The target's tokenizer and the bundle's chat template (draft and target share them),
        or the template given in its place (`--chat-template`)."""
        template = chat_template or bundle.manifest.get("chat_template")
        return cls(bundle.role("target").folder, template)

    def __init__(self, folder: Path, chat_template: str | None):
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = chat_template
        self._kept: dict[int, str] = {}  # special tokens whose text decoding keeps (see keep)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_spans(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of text (no special tokens) and the character each token ends at: where a
        text may be cut so that what follows starts a token."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [end for _, end in encoding.offsets]

    def encode_prompt(
        self,
        prompt: str | Sequence[dict] | Sequence[int],
        tools: Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """Text is tokenized as is; a list of {role, content} dicts goes through the chat
        template (with the tools and the extra variables, where given); a list of ints is
        taken as token ids. With a limit, text found to have more tokens raises PastLimit
        before it is tokenized in full (see `count_past`)."""
        if isinstance(prompt, str):
            text, special = prompt, True
        elif prompt and all(isinstance(m, dict) for m in prompt):
            text = self.render_chat(prompt, tools=tools, **(template_kwargs or {}))
            special = False
        else:
            return [int(t) for t in prompt]
        if limit is not None and (past := self.count_past(text, limit)) is not None:
            raise PastLimit(past)
        return self.encode(text, add_special_tokens=special)

    def count_past(self, text: str, limit: int) -> int | None:
        """At least how many tokens text has, where that is surely more than limit; None where
        it may fit (then it is tokenized whole). A long text is tokenized a piece at a time and
        the count stops once it passes the limit, so a prompt far past the context costs about
        the context's tokens to refuse, not its own (a 64 MB message took two minutes whole);
        the SLACK each cut may add is taken off the count."""
        if len(text) <= SCAN_FROM * limit:
            return None
        count, start = 0, 0
        while start < len(text):
            space = WHITESPACE.search(text, start + SCAN_PIECE)
            end = space.start() if space else len(text)
            count += len(self.encode(text[start:end], add_special_tokens=False)) - SLACK
            if count > limit:
                return count
            start = end
        return None

    def keep(self, markers: Sequence[str]) -> None:
        """Keep these texts in decoded output where the vocabulary makes them special tokens
        (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): a tool-call parser reads them. A
        marker that is no special token decodes as itself already, and costs decode nothing."""
        added = self.tokenizer.get_added_tokens_decoder()
        for text in markers:
            token = self.tokenizer.token_to_id(text)
            if token in added and added[token].special:
                self._kept[token] = text

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if not self._kept or not any(i in self._kept for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        parts, run = [], []
        for i in ids:
            if i in self._kept:
                parts += [self.tokenizer.decode(run, skip_special_tokens=True), self._kept[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, self.tokenizer.decode(run, skip_special_tokens=True)])

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (what a logprob entry names)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        **variables,
    ) -> str:
        """The template's text for these messages; variables: extra ones the template reads
        (Qwen3's enable_thinking), which cannot replace its own."""
        if not self.chat_template:
            raise SpecrtError(
                "this bundle has no chat template (its tokenizer came without one): send a "
                "plain prompt, or give the model's template as a Jinja file with "
                "`specrt serve --chat-template FILE` (or build the bundle with it)"
            )
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            own = {
                "messages": list(messages),
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
                "tools": list(tools) if tools else None,
            }
            return env.from_string(self.chat_template).render({**variables, **own})
        except TemplateError as err:
            raise SpecrtError(f"the chat template rejected these messages: {err}") from err


class IncrementalDecoder:
    """Text deltas as tokens arrive, never splitting a multi-byte character.

    Decodes a short window (the previous read position onwards) instead of the whole sequence,
    keeping only that window's tokens, and holds a delta back while it ends in an incomplete
    UTF-8 sequence.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.read = 0  # of ids, those whose text is already out
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[: self.read])
        after = self.tokenizer.decode(self.ids)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        del self.ids[: self.read]  # decoded for good: keep only the window still being read
        self.read = len(self.ids)
        self.text += delta
        return delta
