"""What a decoder is asked: a question (the pair's template wraps it), a chat (a list of messages the
model's chat template renders), or raw text (read as it is, as OpenAI's ``/v1/completions`` does).

User text never becomes control tokens: any special-token string of the tokenizer (``<|im_start|>``,
``<|endoftext|>``, ...) inside a message is broken by a zero-width space before the template runs, so it
tokenizes as the plain characters a user typed and cannot open a forged system or assistant turn."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

CHAT_ROLES = ("system", "user", "assistant")
_BREAK = "\u200b"  # zero-width space: splits a control-token string into plain text


class RawPrompt(str):
    """Text read by the models exactly as given: no template, special tokens included (the caller's
    choice, as in a raw completion)."""


Message = Mapping[str, str]
Prompt = Union[str, RawPrompt, Sequence[Message]]  # noqa: UP007 (a runtime alias)


def check_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """The messages as plain dicts, checked: at least one, each with a role in ``CHAT_ROLES`` and string
    content. The model answers the last one; a last assistant message is continued (a prefilled reply).
    ValueError says what is wrong."""
    if isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} mappings")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or m.get("role") not in CHAT_ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"messages[{i}] must have a role in {CHAT_ROLES} and string content, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class ControlTokens:
    """A tokenizer's control-token strings, indexed once so that ``neutralize`` reads a text in one pass:
    a tokenizer may have thousands (Gemma's has 6,249), and a replace per token over a long prompt costs
    seconds. The pass visits only positions holding a token's first character and tries the tokens'
    lengths there, longest first."""

    def __init__(self, specials: Iterable[str]) -> None:
        self.tokens = frozenset(t for t in specials if len(t) > 1)
        self.lengths = sorted({len(t) for t in self.tokens}, reverse=True)
        firsts = "".join(sorted({t[0] for t in self.tokens}))
        self._starts = re.compile(f"[{re.escape(firsts)}]") if firsts else None

    def find(self, text: str) -> list[tuple[int, str]]:
        """Every control-token string in ``text`` as (start, token), left to right, longest first where
        several start at one place, never overlapping."""
        if self._starts is None:
            return []
        hits, last = [], 0
        for m in self._starts.finditer(text):
            i = m.start()
            if i < last:
                continue
            for n in self.lengths:
                if text[i : i + n] in self.tokens:
                    hits.append((i, text[i : i + n]))
                    last = i + n
                    break
        return hits

    def neutralize(self, text: str) -> str:
        """``text`` with every control-token string broken after its first character (leftmost, longest
        first), so a tokenizer reads it as the plain characters a user typed."""
        out, last = [], 0
        for i, token in self.find(text):
            out += [text[last:i], token[0], _BREAK, token[1:]]
            last = i + len(token)
        return "".join(out) + text[last:] if out else text


def neutralize(text: str, specials: Sequence[str] | ControlTokens) -> str:
    """``text`` with every occurrence of a special-token string broken after its first character, so a
    tokenizer reads it as plain text (``specials``: the tokenizer's special and added control tokens, or
    their :class:`ControlTokens` index, which a caller keeps to neutralize many texts)."""
    index = specials if isinstance(specials, ControlTokens) else ControlTokens(specials)
    return index.neutralize(text)


def plain_chat(messages: Sequence[Message], template: str) -> str:
    """A chat for a model without a chat template: earlier turns as ``Role: text`` paragraphs, then the
    last user message in the pair's plain ``template``; a last assistant message is continued as it is."""
    *before, last = messages
    lead = "".join(f"{m['role'].title()}: {m['content'].strip()}\n\n" for m in before)
    if last["role"] == "assistant":
        return lead + f"Assistant: {last['content']}"
    return lead + template.format(question=last["content"].strip())
