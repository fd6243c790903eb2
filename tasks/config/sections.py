"""The stages' typed sections of ``params.yaml``: one dataclass per stage, each field commented and checked
in ``__post_init__`` (a bad value is a ValueError naming the section and field). ``semspec.tasks.config``
combines them into ``Params``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from semspec.models.project.names import SMOKE_STAGE, STAGES
from semspec.models.spec.names import (
    ALL_DOMAINS,
    LLAMACPP,
    METHODS,
    PROBE_METHOD,
    PROBE_VARIANTS,
    ROLES,
    check_domain,
    method_label,
    probe_key,
)
from semspec.models.spec.settings import DecodeSettings

EXECUTORS = ("ray", "local")
EVAL_METHODS = (*METHODS, LLAMACPP)  # what evaluate.methods may name (llamacpp: llama.cpp's target)


def _positive(where: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"{where}: field '{k}' must be positive, got {v!r}")


INGEST_SOURCES = ("arith", "s1k", "math500", "aime24", "amc23")  # sources with reasoning chains
# who writes the reasoning chains prefixes are cut from: the data, one model, or SemanticSpec itself (the
# decoder with the pair's registered probes: the contexts it meets when it decodes)
TRACE_AUTHORS = ("data", "target", "draft", "semanticspec")


@dataclass
class IngestConfig:
    """Which questions become prefixes."""

    # where the questions come from: arith (generated offline set), s1k, or a benchmark with reference
    # solutions (math500, aime24, amc23); a list takes max_questions from each, e.g. [arith, math500]
    source: str | list[str] = "arith"
    domains: list[str] | None = None  # keep only these domains (s1K cot_type); None keeps all
    # each prefix's domain (train.domains, evaluate.probe_domain): data (the question's own: s1K's
    # cot_type, 'math' for the math sets) | source (the source's name: arith, math500, ..., so that
    # per-source probes and the paper's cross-domain study (5.4) run offline)
    domain_by: str = "data"
    max_questions: int = 8  # questions taken per source (after the domain filter), seeded shuffle
    max_prefixes_per_question: int = 3  # prefixes kept per question (seeded subset of k = 0..steps-1)
    generate_traces: bool = False  # have the target write a greedy trace where the data has none
    # who writes each question's reasoning chain: data (the source's own; the target fills missing ones
    # with generate_traces) | target | draft (that model writes every chain, greedy, within
    # trace_max_tokens; with draft, the prefixes are contexts the draft wrote, as SemanticSpec's are once
    # it has accepted draft steps) | semanticspec (the SemanticSpec decoder writes every chain, greedy,
    # with the pair's registered champion probes of the all variant: the contexts decoding meets, draft
    # steps and target rewrites, to train the next probes on; needs a trained pair, and reads the
    # registry, which DVC does not track); a list cuts prefixes from each author's chain of every question
    # (mixed contexts, e.g. [data, draft]), up to max_prefixes_per_question per chain
    trace_author: str | list[str] = "data"
    trace_max_tokens: int = 256  # token budget of a generated trace
    seed: int = 0
    on_error: str = "raise"  # raise | skip (counted) on malformed input rows
    data_dir: str | None = None  # local data folder (default: $SEMSPEC_DATA_DIR, else the Hub)

    def __post_init__(self) -> None:
        sources = self.sources()
        bad = [x for x in sources if x not in INGEST_SOURCES]
        if bad or not sources or len(set(sources)) < len(sources):
            raise ValueError(
                f"ingest: field 'source' must be one of {INGEST_SOURCES} or a list of distinct ones, got "
                f"{self.source!r}"
            )
        authors = self.trace_authors()
        if not authors or len(set(authors)) < len(authors) or any(a not in TRACE_AUTHORS for a in authors):
            raise ValueError(
                f"ingest: field 'trace_author' must be one of {TRACE_AUTHORS} or a list of distinct ones, got "
                f"{self.trace_author!r}"
            )
        if self.domain_by not in ("data", "source"):
            raise ValueError(f"ingest: field 'domain_by' must be 'data' or 'source', got {self.domain_by!r}")
        _positive(
            "ingest",
            max_questions=self.max_questions,
            max_prefixes_per_question=self.max_prefixes_per_question,
        )

    def sources(self) -> list[str]:
        """The sources, as a list."""
        return [self.source] if isinstance(self.source, str) else list(self.source)

    def trace_authors(self) -> list[str]:
        """The authors of the chains prefixes are cut from, as a list."""
        return [self.trace_author] if isinstance(self.trace_author, str) else list(self.trace_author)


@dataclass
class SampleConfig:
    """N continuations per prefix and role, with pooled hidden states."""

    n: int = 20  # samples per prefix (paper: 20)
    temperature: float = 0.6
    top_p: float = 0.95
    max_step_tokens: int | None = None  # None: each model's max_step_tokens (the decoding budget)
    batch_prefixes: int = 2  # prefixes per actor call = rows per shard
    store_layers: bool = True  # also store h_layers (float16) for the mix probe
    roles: list[str] = field(default_factory=lambda: list(ROLES))
    executor: str = "ray"  # ray (actors, one model replica each) | local (in-process, for tests)
    actors_per_role: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(
            "sample", n=self.n, batch_prefixes=self.batch_prefixes, actors_per_role=self.actors_per_role
        )
        if self.n < 2:
            raise ValueError(
                f"sample: field 'n' must be at least 2: a step's semantic probability is the share of the N "
                f"samples of its prefix that mean the same (paper: 20), got {self.n}"
            )
        if self.max_step_tokens is not None:
            _positive("sample", max_step_tokens=self.max_step_tokens)
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("sample: fields 'temperature' >= 0 and 'top_p' in (0, 1] required")
        if not self.roles or set(self.roles) - set(ROLES):
            raise ValueError(
                f"sample: field 'roles' must be a non-empty subset of {ROLES}, got {self.roles!r}"
            )
        if self.executor not in EXECUTORS:
            raise ValueError(f"sample: field 'executor' must be one of {EXECUTORS}, got {self.executor!r}")


@dataclass
class ClusterConfig:
    """Semantic clustering of the samples of each prefix."""

    batch_prefixes: int = 16  # prefixes per judge-actor call
    with_question: bool = False  # prepend the question (and prefix) to both sides of each judged pair
    noise: float = 0.0  # fraction of valid samples moved to a wrong cluster (robustness study)
    label_length_cut: bool = True  # label samples cut by the step budget (decoding cuts steps there too)
    executor: str = "ray"
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("cluster", batch_prefixes=self.batch_prefixes)
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"cluster: field 'noise' must be in [0, 1], got {self.noise!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"cluster: field 'executor' must be one of {EXECUTORS}, got {self.executor!r}")


EXAMPLES = ("own", "both")  # train.examples
PROMOTE = ("better", "always")  # train.promote


@dataclass
class TrainConfig:
    """Probe training (Lightning) and registration (MLflow)."""

    variants: list[str] = field(default_factory=lambda: list(PROBE_VARIANTS))
    hidden_target: list[int] = field(default_factory=lambda: [2048, 512])  # paper: D-2048-512-1
    hidden_draft: list[int] = field(default_factory=lambda: [512, 256])  # paper: D-512-256-1
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.01
    batch_size: int = 64
    max_epochs: int = 60
    patience: int = 8  # early stopping on validation MSE
    val_fraction: float = 0.15  # of questions
    test_fraction: float = 0.2  # of questions
    seed: int = 0
    register: bool = True  # register the probes in the MLflow model registry
    # better: a variant's new probes become champion only when they route the held-out questions' draft
    # steps better than the champion (true- minus false-accept; equal keeps it); always: every run's do
    promote: str = "better"
    # `all`: one probe per variant on every domain's data; a list (e.g. [math, science, all]): one probe per
    # variant and listed domain, on that domain's questions only (the paper's 5.4 cross-domain study)
    domains: str | list[str] = ALL_DOMAINS
    # own: each probe on its own model's samples (the paper's and its authors' setting); both: each probe
    # on its model's hidden states over both models' steps (the cross stage), labelled with that model's
    # share in the joint clusters, so it sees steps its model would not say
    examples: str = "own"
    # null: the widths above and weight_decay; a list of candidates ({hidden: [..], weight_decay: x},
    # hidden [] = a linear probe): each is fitted and the one with the lowest validation MSE kept (logged)
    search: list[dict] | None = None
    # learning curves: train on this share of the training questions (a seeded subset, the same for both
    # roles; validation and test questions unchanged)
    train_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.train_fraction, int | float) or not 0 < self.train_fraction <= 1:
            raise ValueError(f"train: field 'train_fraction' must be in (0, 1], got {self.train_fraction!r}")
        if self.promote not in PROMOTE:
            raise ValueError(f"train: field 'promote' must be one of {PROMOTE}, got {self.promote!r}")
        if self.examples not in EXAMPLES:
            raise ValueError(f"train: field 'examples' must be one of {EXAMPLES}, got {self.examples!r}")
        if self.search is not None:
            self._check_search()
        if not self.variants or set(self.variants) - set(PROBE_VARIANTS):
            raise ValueError(
                f"train: field 'variants' must be a non-empty subset of {PROBE_VARIANTS}, got {self.variants!r}"
            )
        if self.domains != ALL_DOMAINS:
            if not isinstance(self.domains, list) or not self.domains:
                raise ValueError(
                    f"train: field 'domains' must be 'all' or a non-empty list such as [math, science], "
                    f"got {self.domains!r}"
                )
            for d in self.domains:
                check_domain(d)
        _positive(
            "train",
            lr=self.lr,
            batch_size=self.batch_size,
            max_epochs=self.max_epochs,
            patience=self.patience,
        )
        if not (
            0 < self.val_fraction < 1
            and 0 < self.test_fraction < 1
            and self.val_fraction + self.test_fraction < 1
        ):
            raise ValueError(
                "train: fields 'val_fraction' and 'test_fraction' must be in (0, 1) and sum below 1"
            )
        if len(self.betas) != 2:
            raise ValueError(f"train: field 'betas' must have two values, got {self.betas!r}")
        for name in ("hidden_target", "hidden_draft"):
            widths = getattr(self, name)
            if not isinstance(widths, list) or any(not isinstance(w, int) or w < 1 for w in widths):
                raise ValueError(
                    f"train: field {name!r} lists the probe's hidden widths, positive integers such as "
                    f"[512, 256], got {widths!r}"
                )

    def hidden(self, role: str) -> list[int]:
        """Hidden widths of the probe for ``role``."""
        return self.hidden_target if role == "target" else self.hidden_draft

    def candidates(self, role: str) -> list[tuple[list[int], float]]:
        """(hidden widths, weight decay) to fit for ``role``: the search's, else the configured one."""
        if self.search is None:
            return [(self.hidden(role), self.weight_decay)]
        return [(list(c["hidden"]), float(c.get("weight_decay", self.weight_decay))) for c in self.search]

    def _check_search(self) -> None:
        ok = isinstance(self.search, list) and self.search
        for c in self.search if ok else []:
            widths = c.get("hidden") if isinstance(c, dict) else None
            ok = ok and isinstance(widths, list) and all(isinstance(w, int) and w >= 1 for w in widths)
            ok = ok and set(c) <= {"hidden", "weight_decay"}
            ok = (
                ok and isinstance(c.get("weight_decay", 0.0), int | float) and c.get("weight_decay", 0.0) >= 0
            )
        if not ok:
            raise ValueError(
                "train: field 'search' must be null or a non-empty list of candidates such as "
                f"[{{hidden: [], weight_decay: 0.1}}, {{hidden: [256], weight_decay: 0.01}}], got {self.search!r}"
            )

    def domain_list(self) -> list[str]:
        """The domains probes are trained for (``all``: every domain's data together)."""
        return [ALL_DOMAINS] if self.domains == ALL_DOMAINS else list(dict.fromkeys(self.domains))


EVAL_BENCHMARKS = ("arith", "math500", "aime24", "amc23", "gpqa")


@dataclass
class EvaluateConfig:
    """Benchmark evaluation of every decoding method."""

    benchmarks: dict[str, int] = field(
        default_factory=lambda: {"arith": 4, "math500": 2}
    )  # name -> problems (0: all)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    probe_variants: list[str] = field(default_factory=lambda: list(PROBE_VARIANTS))  # for semanticspec
    seeds: list[int] = field(default_factory=lambda: [0])
    # the decoders' settings (semspec.models.spec.settings.DecodeSettings, parsed and checked there)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    subset_seed: int = 0  # which problems of each benchmark are taken
    levels: list[int] | None = None  # keep only these difficulty levels where a benchmark has them (MATH-500)
    batch_size: int = 1  # problems decoded at once by step-level methods (token-level: one at a time)
    actors: int | None = None  # Ray actors, each a replica of the pair (None: one per GPU if cuda, else 0)
    probe_domain: str = ALL_DOMAINS  # which domain's probes semanticspec loads (train.domains); `all`: pooled
    llamacpp_bin: str | None = None  # the llamacpp method's llama-server (binary or folder; null: PATH)

    def __post_init__(self) -> None:
        check_domain(self.probe_domain)
        bad = set(self.benchmarks) - set(EVAL_BENCHMARKS)
        if bad or not self.benchmarks:
            raise ValueError(
                f"evaluate: field 'benchmarks' must name some of {EVAL_BENCHMARKS}, got {sorted(bad)}"
            )
        if any(not isinstance(v, int) or v < 0 for v in self.benchmarks.values()):
            raise ValueError("evaluate: field 'benchmarks' maps names to problem counts >= 0 (0: all)")
        if not self.methods or set(self.methods) - set(EVAL_METHODS):
            raise ValueError(f"evaluate: field 'methods' must be a non-empty subset of {EVAL_METHODS}")
        if set(self.probe_variants) - set(PROBE_VARIANTS):
            raise ValueError(f"evaluate: field 'probe_variants' must be a subset of {PROBE_VARIANTS}")
        if not self.seeds:
            raise ValueError("evaluate: field 'seeds' needs at least one seed")
        _positive("evaluate", batch_size=self.batch_size)
        if not isinstance(self.decode, DecodeSettings):
            self.decode = DecodeSettings.from_mapping(self.decode, "evaluate.decode")
        if self.actors is not None and (not isinstance(self.actors, int) or self.actors < 0):
            raise ValueError(f"evaluate: field 'actors' must be null or a count >= 0, got {self.actors!r}")
        if self.levels is not None and (
            not self.levels or any(not isinstance(v, int) or not 1 <= v <= 5 for v in self.levels)
        ):
            raise ValueError(
                f"evaluate: field 'levels' must list levels 1..5 (or be null), got {self.levels!r}"
            )

    def method_labels(self) -> list[str]:
        """One label per evaluated decoder: semanticspec expands to semanticspec-<variant> (with
        ``@<domain>`` for one domain's probes, so in- and cross-domain rows sit side by side)."""
        out = []
        for m in self.methods:
            if m == PROBE_METHOD:
                out += [method_label(m, probe_key(v, self.probe_domain)) for v in self.probe_variants]
            else:
                out.append(m)
        return out


@dataclass
class RetrainConfig:
    """The scheduled ``semspec/retrain`` deployment: when it runs and which stages it reruns."""

    cron: str = "0 3 * * 1"  # weekly, Monday 03:00
    timezone: str = "UTC"
    stages: list[str] = field(default_factory=lambda: list(STAGES))

    def __post_init__(self) -> None:
        fields_ = self.cron.split()
        if len(fields_) != 5 or not all(re.fullmatch(r"[\w*/,\-]+", f) for f in fields_):
            raise ValueError(
                f"retrain: field 'cron' must be a 5-field cron expression (minute hour day month weekday), "
                f"got {self.cron!r}"
            )
        known = (*STAGES, SMOKE_STAGE)
        bad = [s for s in self.stages if s not in known]
        if bad or not self.stages:
            raise ValueError(
                f"retrain: field 'stages' must be a non-empty subset of {known}, got {self.stages}"
            )
