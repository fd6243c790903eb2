"""semspec: semantic-aware speculative decoding (SemanticSpec) for reasoning LLMs.

>>> import semspec
>>> llm = semspec.load("qwen-coder")                      # or probes="exported-folder/" or "org/repo"
>>> out = llm.generate("A train travels 120 km in 2 hours. What is its speed?")
>>> out.text, [(s.author, s.accepted, s.p, s.q) for s in out.steps]
>>> for step in llm.stream("..."): ...                     # steps as they are decided
>>> llm.generate([q1, q2, q3])                             # decoded together
>>> llm.generate(q, method="target")                       # a baseline

The names below are imported on first use, so ``import semspec`` (and the ``semspec`` command, whose
modules live in this package) does not pay for torch and transformers until a model is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "semspec.api",
    "SemanticSpec": "semspec.api",
    "Generation": "semspec.api",
    "Step": "semspec.api",
    "SETTINGS": "semspec.api",
    "RawPrompt": "semspec.models.lm.prompts",
}
__all__ = ["SETTINGS", "Generation", "RawPrompt", "SemanticSpec", "Step", "__version__", "load"]

if TYPE_CHECKING:
    from semspec.api import SETTINGS, Generation, SemanticSpec, Step, load
    from semspec.models.lm.prompts import RawPrompt


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'semspec' has no attribute {name!r}")
