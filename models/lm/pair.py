"""The model-pair schema: what to load for the draft, the target and the judge.

A pair lives in ``conf/pairs/<name>.yaml`` (found by ``semspec.models.project.pairs``) and is parsed once, at
the entry point, into these dataclasses. Every field is validated in ``__post_init__`` so a bad model config fails with a message
naming the field instead of crashing later inside transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from semspec.models.cpu.formats import FORMATS, QUANTIZED
from semspec.models.spec.names import ROLES

SOURCES = ("hub", "local", "package")
MODEL_SOURCES = (*SOURCES, "parts")  # parts: one GGUF file split over several PyPI packages
PROMPTS = ("auto", "chat", "plain")
JUDGE_KINDS = ("embedding", "nli")
POOLINGS = ("predict", "tokens")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?|mps)$")


def _fail(where: str, name: str, msg: str) -> ValueError:
    return ValueError(f"{where}: field '{name}' {msg}")


def from_mapping(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with the field name."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known fields are {sorted(known)}")
    return cls(**data, where=where) if "where" in known else cls(**data)


@dataclass
class ModelConfig:
    """How to load one causal LM and how to prompt it."""

    model_id: str  # stable identity recorded with artifacts and probe tags (e.g. a Hub id)
    source: str = "hub"  # hub: Hub id; local: a folder; package: an installed PyPI package; parts: see below
    path: str = ""  # Hub id, local folder, or package name (defaults to model_id for hub; unused for parts)
    gguf_file: str | None = None  # GGUF file name inside `path` (parts: the joined file's name)
    assemble: bool = False  # package source: call the package's `assemble(path)` to build the file
    packages: list[str] = field(default_factory=list)  # parts: pinned pip requirements, in part order
    part_pattern: str = "data/part*.bin"  # parts: the one file of each package that holds its part
    sha256: str | None = None  # sha256 of the GGUF file (required for parts; checked once per file)
    # the format (models/cpu/formats.py): float32 | float16 | bfloat16 | int8 | int4 (weight-only, CPU) | auto
    # (the fastest correct one for the machine: bfloat16 on a GPU; on a CPU int4 with AVX512_BF16, else int8)
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:N | mps | auto
    prompt: str = "auto"  # auto: chat template when the tokenizer has one, else plain_template
    plain_template: str = "Question: {question}\nAnswer: Let's think step by step.\n\n"
    system_prompt: str | None = None  # optional system message for chat templates
    delimiter: str = "\n\n"  # step delimiter
    max_step_tokens: int = 64  # budget for one reasoning step
    trust_remote_code: bool = False  # never on unless a model config says so explicitly
    where: str = field(default="model", repr=False, compare=False)
    # what a step is (models/spec/steps.py): params.yaml's split_strategy, set by load_pair, never by a pair file
    split: str = field(default="paragraph", init=False)
    # which positions a step's hidden states are pooled over (models/lm/): the pair's `pooling`, set by
    # PairConfig, never per model: both probes and both models of a pair pool alike
    pooling: str = field(default="predict", init=False)

    def __post_init__(self) -> None:
        w = self.where
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise _fail(w, "model_id", "must be a non-empty string")
        if self.source not in MODEL_SOURCES:
            raise _fail(w, "source", f"must be one of {MODEL_SOURCES}, got {self.source!r}")
        if not self.path:
            if self.source not in ("hub", "parts"):
                raise _fail(w, "path", f"is required for source '{self.source}'")
            self.path = self.model_id
        self._check_parts()
        if self.dtype not in FORMATS:
            raise _fail(w, "dtype", f"must be one of {FORMATS}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise _fail(w, "device", f"must be cpu, cuda, cuda:N, mps or auto, got {self.device!r}")
        if self.dtype in QUANTIZED and self.device not in ("cpu", "auto"):
            raise _fail(w, "dtype", f"{self.dtype} is a CPU format; on {self.device} use bfloat16 or auto")
        if self.prompt not in PROMPTS:
            raise _fail(w, "prompt", f"must be one of {PROMPTS}, got {self.prompt!r}")
        if "{question}" not in self.plain_template:
            raise _fail(w, "plain_template", "must contain the placeholder {question}")
        if not isinstance(self.delimiter, str) or not self.delimiter:
            raise _fail(w, "delimiter", "must be a non-empty string such as '\\n\\n'")
        if not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1:
            raise _fail(w, "max_step_tokens", f"must be a positive integer, got {self.max_step_tokens!r}")
        if self.assemble and self.source != "package":
            raise _fail(w, "assemble", "is only meaningful with source 'package'")
        if self.gguf_file is not None and not str(self.gguf_file).endswith(".gguf"):
            raise _fail(w, "gguf_file", f"must name a .gguf file, got {self.gguf_file!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise _fail(w, "trust_remote_code", "must be true or false")

    def _check_parts(self) -> None:
        w = self.where
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", str(self.sha256)):
            raise _fail(w, "sha256", f"must be 64 hex digits, got {self.sha256!r}")
        if self.source != "parts":
            if self.packages:
                raise _fail(w, "packages", "is only meaningful with source 'parts'")
            return
        if not isinstance(self.packages, list) or not self.packages:
            raise _fail(w, "packages", "must list the part packages in order, e.g. ['name-part1==1.0', ...]")
        bad = [p for p in self.packages if not isinstance(p, str) or "==" not in p]
        if bad:
            raise _fail(w, "packages", f"must pin each package with ==, e.g. 'name-part1==1.0'; got {bad}")
        if not self.gguf_file:
            raise _fail(w, "gguf_file", "is required for source 'parts' (the joined file's name)")
        if not self.sha256:
            raise _fail(w, "sha256", "is required for source 'parts' (the joined file is checked against it)")
        if not isinstance(self.part_pattern, str) or not self.part_pattern:
            raise _fail(w, "part_pattern", "must be a glob such as 'data/part*.bin'")

    @property
    def uses_cuda(self) -> bool:
        """Whether this model wants a GPU (Ray actors then request ``num_gpus``)."""
        return self.device.startswith("cuda")


@dataclass
class JudgeConfig:
    """The semantic-equivalence judge used to cluster sampled steps."""

    kind: str = "embedding"  # embedding (sentence embeddings + cosine) | nli (MNLI classifier)
    model_id: str = "sentence-transformers/all-MiniLM-L6-v2"
    source: str = "hub"  # hub | local | package
    path: str = ""  # Hub id, folder, or package name; defaults to model_id for hub
    device: str = "cpu"
    threshold: float = 0.9  # embedding: cosine at or above which two steps are equivalent
    numbers_must_match: bool = False  # embedding: steps ending on different numbers are never equivalent
    nli_mode: str = "strict"  # nli: strict (both entail) | lenient (no contradiction, not both neutral)
    batch_size: int = 32
    trust_remote_code: bool = False
    sha256: str | None = None  # of weights_file: checked before the judge loads (packaged weights)
    weights_file: str = "model.safetensors"
    where: str = field(default="judge", repr=False, compare=False)

    def __post_init__(self) -> None:
        w = self.where
        if self.kind not in JUDGE_KINDS:
            raise _fail(w, "kind", f"must be one of {JUDGE_KINDS}, got {self.kind!r}")
        if self.source not in SOURCES:
            raise _fail(w, "source", f"must be one of {SOURCES}, got {self.source!r}")
        if not self.path:
            if self.source != "hub":
                raise _fail(w, "path", f"is required for source '{self.source}'")
            self.path = self.model_id
        if not _DEVICE_RE.match(str(self.device)):
            raise _fail(w, "device", f"must be cpu, cuda, cuda:N, mps or auto, got {self.device!r}")
        if not isinstance(self.threshold, int | float) or not 0.0 < float(self.threshold) <= 1.0:
            raise _fail(w, "threshold", f"must be in (0, 1], got {self.threshold!r}")
        if self.nli_mode not in ("strict", "lenient"):
            raise _fail(w, "nli_mode", f"must be 'strict' or 'lenient', got {self.nli_mode!r}")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", str(self.sha256)):
            raise _fail(w, "sha256", f"must be 64 hex digits, got {self.sha256!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise _fail(w, "batch_size", f"must be a positive integer, got {self.batch_size!r}")


@dataclass
class PairConfig:
    """A draft/target pair plus the judge that labels their samples."""

    name: str
    draft: ModelConfig
    target: ModelConfig
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    description: str = ""
    # predict: the positions whose outputs predict the step's tokens; tokens: the step's own tokens (the
    # paper's wording). Sampling, training and decoding all read it; a probe records it and decoding
    # refuses a probe pooled otherwise
    pooling: str = "predict"

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pair: field 'pooling' must be one of {POOLINGS}, got {self.pooling!r}")
        for model_cfg in (self.draft, self.target):
            model_cfg.pooling = self.pooling
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name or ""):
            raise ValueError(
                f"pair: field 'name' must be letters, digits, '.', '_' or '-' (used in registry names), "
                f"got {self.name!r}"
            )

    def role(self, role: str) -> ModelConfig:
        """The model config of ``role`` ('draft' or 'target')."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.draft if role == "draft" else self.target

    @classmethod
    def from_dict(cls, data: Any, where: str = "pair") -> PairConfig:
        """Parse and validate a pair mapping (as read from YAML)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping with name, draft, target, judge")
        missing = [k for k in ("name", "draft", "target") if k not in data]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        unknown = sorted(set(data) - {"name", "draft", "target", "judge", "description", "pooling"})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}")
        return cls(
            name=data["name"],
            draft=from_mapping(ModelConfig, data["draft"], f"{where}.draft"),
            target=from_mapping(ModelConfig, data["target"], f"{where}.target"),
            judge=from_mapping(JudgeConfig, data.get("judge") or {}, f"{where}.judge"),
            description=str(data.get("description", "")),
            pooling=data.get("pooling", "predict"),
        )
