"""The LM adapter: load a causal LM from a model config, prompt it, sample reasoning steps and pool hidden states.

One code path serves the Hub, a local folder and the GGUF files shipped in PyPI packages.

Hidden-state pooling (shared by sampling, training and decoding; the pair's ``pooling``):
a step with tokens ``s_0 .. s_{k-1}`` written after a context ``c_0 .. c_{m-1}`` is summarised by
the mean of every layer's hidden state over

* ``predict``: the positions whose outputs *predict* the step's tokens — the last context position
  ``c_{m-1}`` and the step tokens ``s_0 .. s_{k-2}`` (all known when the step ends);
* ``tokens``: the step's own tokens ``s_0 .. s_{k-1}`` (the paper's wording). The output at ``s_{k-1}``
  exists only once that token is fed, which generation does at the start of the next step (or in one
  extra batched forward when there is none). An EOS token is not a step token and is not pooled.

From the pooled ``(L+1, D)`` matrix (embeddings + L blocks) we keep:

* ``h_last``   ``[D]``: the last layer (after the final norm);
* ``h_mean``   ``[D]``: the mean over the L block outputs (the paper's all-layer feature);
* ``h_layers`` ``[(L+1), D]``: every layer, for layer-mixing probes.

Generation and prefill pool over the same positions, so the same text gives the same vector.

The package: ``types`` (the values above and the decode loop's inputs and outputs), ``cache`` (window
checks, cropping, stacking per-row caches), ``adapter`` (``LM``, which holds four parts, each given what
it reads: ``text.Text``: prompts and tokenization; ``forward.Forwards``: forwards, prefill and extend;
``scoring.Scorer``: scoring steps, greedy agreement and resume; ``step_decoding.StepWriter``: step sampling
and decode runs), ``step_loop`` (the batched decode loop), ``sampling`` (nucleus draws) and ``loading``
(``load_lm`` and the cache of converted GGUF files). Everything callers use is importable from
``semspec.models.lm``.
"""

from semspec.models.lm.adapter import LM
from semspec.models.lm.cache import crop_to, fits_window
from semspec.models.lm.loading import install_kernels, load_lm, pick_device
from semspec.models.lm.prompts import Prompt, RawPrompt, check_messages
from semspec.models.lm.types import (
    LMState,
    NextBudget,
    Partial,
    Pooled,
    StepSample,
    StepScore,
    StepStart,
)

__all__ = [
    "LM",
    "LMState",
    "NextBudget",
    "Partial",
    "Pooled",
    "Prompt",
    "RawPrompt",
    "StepSample",
    "StepScore",
    "StepStart",
    "check_messages",
    "crop_to",
    "fits_window",
    "install_kernels",
    "load_lm",
    "pick_device",
]
