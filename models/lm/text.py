"""The text side of ``LM`` (``Text``): the delimiter check, prompts (a question, messages or a raw prompt in
the pair's template), token ids of a context and of a continuation, and where a step's tokens end it."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from semspec.models.lm.pair import ModelConfig
from semspec.models.lm.prompts import ControlTokens, Prompt, RawPrompt, check_messages, neutralize, plain_chat
from semspec.models.spec.steps import step_end


class Text:
    """A model's prompts and tokenization: everything here reads the tokenizer and the model config only.
    ``eos_ids`` are the token ids that end a reply (the generation config's and the tokenizer's)."""

    def __init__(self, tokenizer: Any, model_cfg: ModelConfig, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.config = model_cfg
        self.eos_ids = eos_ids
        self.model_id = model_cfg.model_id
        self.check_delimiter()

    def check_delimiter(self) -> None:
        """Refuse a tokenizer that cannot write the step delimiter (encoded, then decoded): no step would
        ever end at it and every step would run to its token budget."""
        mark = self.config.delimiter if self.config.split == "paragraph" else ". "
        ids = self.tokenizer.encode(f"a{mark}b", add_special_tokens=False)
        if mark not in self.tokenizer.decode(ids, skip_special_tokens=True):
            raise ValueError(
                f"{self.config.model_id}: its tokenizer cannot write the step delimiter {mark!r} (it does not "
                f"survive encoding and decoding); set another `delimiter` in the pair file"
            )

    def uses_chat_template(self) -> bool:
        """Whether prompts are built with the tokenizer's chat template."""
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if self.config.prompt == "chat" and not has:
            raise ValueError(
                f"{self.model_id}: the model config says prompt: chat but the tokenizer has no chat template; "
                f"use prompt: plain or auto"
            )
        return self.config.prompt == "chat" or (self.config.prompt == "auto" and has)

    def format_prompt(self, question: Prompt) -> str:
        """The text that precedes the first reasoning step: ``question`` in the pair's template (a chat
        template's user turn, else ``plain_template``); a list of messages rendered by the chat template
        (or as plain paragraphs); a ``RawPrompt`` as it is. Control-token strings inside user text are
        neutralized (``models/lm/prompts.py``)."""
        if isinstance(question, RawPrompt):
            if not question:
                raise ValueError("the prompt is empty")
            return str(question)
        if isinstance(question, str):
            if not question.strip():
                raise ValueError("question must be a non-empty string")
            messages = [{"role": "user", "content": question.strip()}]
        else:
            messages = check_messages(question)
        specials = self.control_tokens
        messages = [{**m, "content": neutralize(m["content"], specials)} for m in messages]
        if not self.uses_chat_template():
            return plain_chat(messages, self.config.plain_template)
        if self.config.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        reply = messages[-1]["role"] == "assistant"  # a prefilled reply: continue it
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=not reply, continue_final_message=reply, tokenize=False
            )
        except Exception as e:  # jinja's TemplateError: the template's own rules (alternating roles, ...)
            raise ValueError(f"{self.model_id}'s chat template refuses these messages: {e}") from None

    @cached_property
    def control_tokens(self) -> ControlTokens:
        """Every special or added token string of the tokenizer, indexed once per model."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        # every added token, flagged special or not (Gemma's <start_of_image> is not): each reaches the
        # model as its own id when its string appears in text
        return ControlTokens({*self.tokenizer.all_special_tokens, *(t.content for t in added.values())})

    def next_turn(self, instruction: str, reply_start: str) -> str:
        """The text that closes the assistant's turn, asks ``instruction`` as a new user turn and opens
        the assistant's reply with ``reply_start`` (SpecReason's verification). With a chat template the
        turns are the template's own; without one, plain lines."""
        if not self.uses_chat_template():
            return f"\n\n{instruction}\n{reply_start}"
        mark = "\x00semspec-turn\x00"
        messages = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": mark},
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": reply_start},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        if text.count(mark) != 1:
            raise ValueError(f"{self.model_id}: the chat template does not keep assistant turns verbatim")
        return text.split(mark, 1)[1]

    def encode(self, text: str) -> list[int]:
        """Token ids of a full context (special tokens added unless the text already starts with BOS)."""
        bos = self.tokenizer.bos_token
        add = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add)["input_ids"])

    def continuation_ids(self, prev_text: str, prev_ids: list[int], new_text: str) -> list[int]:
        """Ids of ``new_text`` as it tokenizes after ``prev_text`` (falls back to standalone tokenization
        when the boundary would merge tokens with the cached context). Control-token strings in
        ``new_text`` (a model's own text, or a user's prefilled reply) are read as plain characters."""
        if hits := self.control_tokens.find(new_text):
            # model text that spells a control token stays plain text: each such string is read in two
            # pieces, so it never becomes the control id (split_special_tokens would flip a setting of the
            # tokenizer that other threads read)
            ids, last = [], 0
            for i, token in hits:
                ids += self.plain_ids(new_text[last:i]) + self.plain_ids(token[0]) + self.plain_ids(token[1:])
                last = i + len(token)
            return ids + self.plain_ids(new_text[last:])
        full = self.encode(prev_text + new_text)
        if full[: len(prev_ids)] == prev_ids:
            return full[len(prev_ids) :]
        return self.plain_ids(new_text)

    def plain_ids(self, text: str) -> list[int]:
        """Ids of ``text`` alone, no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_stop(self, toks: list[int]) -> tuple[str, str] | None:
        """(text, reason) when ``toks`` ends the step, else None."""
        if toks[-1] in self.eos_ids:
            return self.decode(toks[:-1]), "eos"
        # decoding only the tail keeps this O(1) per token; an end earlier would have stopped us
        split, delimiter = self.config.split, self.config.delimiter
        tail = self.decode(toks[-8:])
        if step_end(tail, split, delimiter) is None:
            return None
        text = self.decode(toks)
        cut = step_end(text, split, delimiter)
        return None if cut is None else (text[:cut], "delimiter")
