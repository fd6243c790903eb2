"""Answers of models whose chat template thinks first (``<think> ... </think>`` then the answer, as the
DeepSeek-R1 distills write): the reasoning is returned apart from the answer, as OpenAI-compatible servers
return it (``reasoning_content`` beside ``content``, vLLM's ``deepseek_r1`` reasoning parser).

Everything before the end marker is reasoning, a leading start marker dropped; an answer whose reasoning
never ended is all reasoning and has no content. :class:`ThinkSplit` does the same to a stream of text,
holding back a tail that could begin the end marker, so a marker split across two steps is still found.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a chat template makes its model think first (it opens or strips a ``<think>`` block)."""
    return bool(chat_template) and (START in chat_template or END in chat_template)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(reasoning, content) of a whole answer; content is None where the reasoning never ended."""
    reasoning, sep, content = text.partition(END)
    reasoning = reasoning.removeprefix(START) if reasoning.lstrip().startswith(START) else reasoning
    if not sep:
        return reasoning.strip(), None
    return reasoning.strip(), content.lstrip("\n")


class ThinkSplit:
    """A streamed answer's text, fed in order, told apart into reasoning and content deltas."""

    def __init__(self) -> None:
        self.held = ""  # text that may begin the end marker (or the start marker, at the very start)
        self.done = False  # the end marker was read: the rest is content
        self.started = False  # something of the reasoning was released (a start marker can no longer come)
        self.answering = False  # something of the content was released (its leading newlines are dropped)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that may be released after ``text``."""
        if self.done:
            return "", self._content(text)
        buf = self.held + text
        if END in buf:
            before, _, after = buf.partition(END)
            self.held, self.done = "", True
            return self._reasoning(before), self._content(after)
        keep = next((n for n in range(min(len(END) - 1, len(buf)), 0, -1) if END.startswith(buf[-n:])), 0)
        self.held = buf[len(buf) - keep :]
        return self._reasoning(buf[: len(buf) - keep]), ""

    def rest(self) -> str:
        """The held tail, released as reasoning once the answer ended without the marker."""
        out, self.held = self.held, ""
        if self.done:
            return ""
        return out if self.started else out.lstrip().removeprefix(START)

    def _content(self, text: str) -> str:
        if not self.answering:
            text = text.lstrip("\n")
            self.answering = bool(text)
        return text

    def _reasoning(self, text: str) -> str:
        if not self.started and text:
            stripped = text.lstrip()
            if START.startswith(stripped):  # maybe only part of the start marker so far: wait for more
                self.held = text + self.held
                return ""
            text = stripped.removeprefix(START).lstrip("\n") if stripped.startswith(START) else text
            self.started = bool(text)
        return text
