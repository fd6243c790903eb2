"""``LM``: a causal LM and its tokenizer as the decoders and stages use it. Its methods are grouped by job
in mixins: ``text`` (prompts, encoding, where a step ends), ``forward`` (forwards, prefill, extend),
``scoring`` (scoring steps, greedy agreement, resume) and ``step_decoding`` (step sampling; the loop itself
is ``step_loop``); ``LM`` combines them and holds the model, the tokenizer and the state they share."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from semspec.models.cpu import attention, decode_layer, int4_kernel, int8_kernel
from semspec.models.cpu.formats import Format, resolve_format
from semspec.models.lm.forward import ForwardMixin
from semspec.models.lm.pair import ModelConfig
from semspec.models.lm.scoring import ScoringMixin
from semspec.models.lm.step_decoding import StepDecodingMixin
from semspec.models.lm.text import TextMixin


class LM(TextMixin, ForwardMixin, ScoringMixin, StepDecodingMixin):
    """A causal LM plus its tokenizer, with step-level sampling and hidden-state pooling."""

    def __init__(
        self, model: PreTrainedModel, tokenizer, model_cfg: ModelConfig, fmt: Format | None = None
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model_cfg
        self.device = next(model.parameters()).device  # its kernels are the loader's (install_kernels)
        # what the model runs in (``load_lm`` resolves and applies it; a model built in memory: its dtype)
        self.format: Format = fmt or _dense_format(model)
        text_cfg = model.config.get_text_config()
        self.num_layers: int = int(text_cfg.num_hidden_layers)
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.eos_ids: set[int] = _eos_ids(model, tokenizer)
        self.load_seconds: float = 0.0
        # an empty cache of this model's layer types, built once: its sliding windows bound padded batches
        self.cache_layout = DynamicCache(config=model.config)
        self._check_delimiter()
        window = getattr(text_cfg, "max_position_embeddings", None)
        self.context_window: int | None = int(window) if window else None  # positions the model was built for

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
