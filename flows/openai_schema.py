"""The request and response bodies of the server's OpenAI-compatible endpoints (pydantic).

Requests reject unknown fields (``extra="forbid"``): a misspelt option fails loudly instead of being
ignored. Besides OpenAI's fields a request may carry ``method`` (a baseline through the same endpoint)
and ``seed``; every response carries the SemanticSpec trace in the extension field ``semspec``.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

T = TypeVar("T")

# the methods a server decodes: the step-level ones, which share the batched step loop
SERVED_METHODS = ("semanticspec", "target", "draft", "specreason")
Method = Literal["semanticspec", "target", "draft", "specreason"]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1)]
# an OpenAI option accepted at its neutral value 0 only: the schema says so (clients and fuzzers read it),
# and a validator refuses any other value with a message that names the option
Neutral = Annotated[T, Field(json_schema_extra={"minimum": 0, "maximum": 0})]


class TextPart(BaseModel):
    """A part of a message's content, in OpenAI's list form; text is the one kind a text model reads."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Annotated[str, Field(max_length=200_000)]


class ChatMessage(BaseModel):
    """One message of a chat. ``developer`` is OpenAI's newer name for the system role; content is a
    string or a list of text parts (joined by newlines, as vLLM joins them)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=200_000)] | Annotated[list[TextPart], Field(max_length=256)]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """``{role, content}`` as the models read it: ``developer`` as ``system``, parts joined."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text is what every answer is."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # the served pair's name (GET /v1/models); None: it
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    user: str | None = None
    # the answer ends before any of them; an empty list means none, as vLLM reads it
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    # OpenAI's options at their neutral values only: a request that asks for more is refused by name
    presence_penalty: Neutral[float] | None = None
    frequency_penalty: Neutral[float] | None = None
    method: Method = "semanticspec"  # semspec's extension: a baseline through the same endpoint

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v not in (None, 0):
            raise ValueError(f"semspec does not support {info.field_name} other than 0")
        return v

    @field_validator("max_tokens", "max_completion_tokens", "seed", mode="before", check_fields=False)
    @classmethod
    def _json_int(cls, v: object) -> object:
        """A JSON integer may be written ``3.0`` (JSON Schema's integer); ``true`` and ``"3"`` stay refused."""
        return int(v) if isinstance(v, float) and v.is_integer() else v

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _finite(cls, v: object) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[bool, Field(json_schema_extra={"enum": [False]})] | None = None
    top_logprobs: Neutral[int] | None = None
    response_format: ResponseFormat | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None  # no tools are called: any value means the same

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("semspec does not support logprobs (steps are accepted whole): send false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("semspec does not support top_logprobs other than 0")
        return v


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is read as it is (no chat template)."""

    logprobs: Literal[0] | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None

    prompt: (
        Annotated[str, Field(min_length=1, max_length=200_000)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=200_000)]], Field(min_length=1, max_length=1)
        ]
    )


class StepOut(BaseModel):
    """One step of the trace."""

    author: Literal["draft", "target"]
    text: str
    accepted: bool | None
    p: float | None = None
    q: float | None = None
    tokens: int = 0
    rejected_by: str | None = (
        None  # why the target wrote the step: ratio, floor, target_rule, token_check, ...
    )


class Trace(BaseModel):
    """The ``semspec`` extension field: how the answer was decoded."""

    method: str  # what the request asked for
    ran_as: str  # what decoded it (the target where speculation was off in every round)
    speculation: bool  # speculated in every round (never switched off under load)
    rounds_without_speculation: int = 0  # rounds in which the target wrote its step alone under load
    spec_max_batch: int | None
    steps: list[StepOut] = Field(default_factory=list)
    target_share: float | None = None
    acceptance_rate: float | None = None
    queue_seconds: float | None = None
    decode_seconds: float | None = None


class Usage(BaseModel):
    """Token counts (the target's tokenizer)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: dict[str, int] | None = None  # reasoning_tokens, for a model that thinks


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every failed request gets."""

    error: ErrorBody


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "semspec"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatChoice(BaseModel):
    """A chat completion's one choice."""

    index: int
    message: dict[str, str]
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    semspec: Trace


class CompletionChoice(BaseModel):
    """A completion's one choice."""

    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Completion(BaseModel):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    semspec: Trace


def ok_responses(model: type[BaseModel]) -> dict[int | str, dict]:
    """The 200 of an endpoint that answers ``model`` as JSON, or server-sent events with ``stream``."""
    # each event carries a chunk object, the last one "[DONE]": no one JSON schema covers both
    events = {"schema": {"description": "server-sent events: data: <chunk JSON> per step, then data: [DONE]"}}
    return {200: {"model": model, "content": {"text/event-stream": events}}}
