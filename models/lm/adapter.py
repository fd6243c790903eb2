"""``LM``: a causal LM and its tokenizer as the decoders and stages use it, composed of four parts with
explicit dependencies: ``text`` (``Text``: prompts, encoding, where a step ends), ``forwards``
(``Forwards``: forwards, prefill, extend; reads ``text``), ``scorer`` (``Scorer``: scoring steps, greedy
agreement, resume; reads both) and ``writer`` (``StepWriter``: step sampling, whose loop is ``step_loop``;
reads both). ``LM``'s calls are its parts' methods (``_PartCall``), so a caller needs no part's name."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from semspec.models.cpu import attention, decode_layer, int4_kernel, int8_kernel
from semspec.models.cpu.formats import Format, resolve_format
from semspec.models.lm.forward import Forwards
from semspec.models.lm.pair import ModelConfig
from semspec.models.lm.scoring import Scorer
from semspec.models.lm.step_decoding import StepWriter
from semspec.models.lm.text import Text


class _PartCall:
    """A call of ``LM`` that is one of its parts' methods, looked up on the part at each use: ``lm.encode``
    is ``lm.text.encode`` (so what replaces a part's method, a test's spy included, serves every caller)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, lm: Any, owner: type | None = None) -> Any:
        return self if lm is None else getattr(getattr(lm, self.part), self.name)


class LM:
    """A causal LM plus its tokenizer, with step-level sampling and hidden-state pooling. ``fmt`` is what
    the model runs in (``load_lm`` resolves and applies it, and installs its kernels; a model built in
    memory: its dtype)."""

    def __init__(
        self, model: PreTrainedModel, tokenizer, model_cfg: ModelConfig, fmt: Format | None = None
    ) -> None:
        self.config = model_cfg
        self.text = Text(tokenizer, model_cfg, _eos_ids(model, tokenizer))
        self.forwards = Forwards(model, self.text, fmt or _dense_format(model))
        self.scorer = Scorer(self.text, self.forwards)
        self.writer = StepWriter(self.text, self.forwards)
        self.load_seconds: float = 0.0

    # the calls, each its part's: one object does each job, the LM names them
    # text
    uses_chat_template = _PartCall("text")
    format_prompt = _PartCall("text")
    next_turn = _PartCall("text")
    encode = _PartCall("text")
    continuation_ids = _PartCall("text")
    plain_ids = _PartCall("text")
    check_stop = _PartCall("text")
    decode = _PartCall("text")
    # forwards
    forward = _PartCall("forwards")
    head = _PartCall("forwards")
    forward_rows = _PartCall("forwards")
    prefill = _PartCall("forwards")
    prefill_many = _PartCall("forwards")
    extend = _PartCall("forwards")
    extend_many = _PartCall("forwards")
    # scorer
    score_step = _PartCall("scorer")
    score_steps = _PartCall("scorer")
    score_runs = _PartCall("scorer")
    read_tokens = _PartCall("scorer")
    greedy_agreement = _PartCall("scorer")
    resume_after = _PartCall("scorer")
    # writer
    generate_step = _PartCall("writer")
    generate_steps = _PartCall("writer")
    decode_steps = _PartCall("writer")
    decode_runs = _PartCall("writer")

    @property
    def model(self) -> PreTrainedModel:
        """The Hugging Face model."""
        return self.forwards.model

    @property
    def tokenizer(self):
        """The model's tokenizer."""
        return self.text.tokenizer

    @property
    def format(self) -> Format:
        """What the model runs in."""
        return self.forwards.format

    @property
    def device(self) -> torch.device:
        """The device the model runs on."""
        return self.forwards.device

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a reply."""
        return self.text.eos_ids

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (hidden states have one more: the embeddings)."""
        return self.forwards.num_layers

    @property
    def hidden_size(self) -> int:
        """The width of a hidden state."""
        return self.forwards.hidden_size

    @property
    def context_window(self) -> int | None:
        """Positions the model was built for (None: not stated)."""
        return self.forwards.context_window

    @property
    def model_id(self) -> str:
        """The model config's stable identity."""
        return self.config.model_id

    @property
    def dtype_name(self) -> str:
        """The format the model runs in (e.g. ``bfloat16``, ``int8 (bfloat16 above 4 rows)``), printed
        beside every speed figure."""
        return self.format.label()

    def describe(self) -> dict[str, str]:
        """``{model_id, dtype, format, device, why}``: what every speed figure is printed beside (``format``
        is the short name probes are tagged with, ``why`` the format's choice on this machine)."""
        return {
            "model_id": self.model_id,
            "dtype": self.dtype_name,
            "format": self.format.name,
            "device": str(self.device),
            "why": self.format.describe()
            + {"int8": f"; {int8_kernel.describe()}", "int4": f"; {int4_kernel.describe()}"}.get(
                self.format.name, ""
            )
            + f"; {attention.describe(self.model)}"
            + (f"; {layers}" if (layers := decode_layer.describe(self.model)) else ""),
        }

    def __str__(self) -> str:
        return "{model_id} ({dtype}, {device})".format(**self.describe())


def _eos_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    for v in (gen_eos, tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(x) for x in v)
    return ids


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dense_format(model: PreTrainedModel) -> Format:
    """The format of a model built in memory: its parameters' dtype."""
    return resolve_format(
        dtype_name(next(model.parameters()).dtype), "cuda" if model.device.type == "cuda" else "cpu"
    )
