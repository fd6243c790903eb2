"""The Python API: ``semspec.load(pair)`` returns a :class:`SemanticSpec` that generates with any method.

Loading reads the pair file and checks the probes (the local registry's champions, or an exported folder
or Hub repo) *before* any model loads, then loads both models once; every later call reuses them.
Settings are keyword arguments whose defaults are ``params.yaml``'s ``evaluate.decode`` section, so an answer
here is decoded as the evaluation decodes it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from semspec.models.lm import LM, Prompt
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.batching import BatchDecoder
from semspec.models.spec.names import METHODS, PROBE_METHOD, ROLES
from semspec.models.spec.results import DecodeResult, StepRecord
from semspec.models.spec.settings import DecodeSettings

log = logging.getLogger(__name__)

# the settings a call may pass: every DecodeSettings field (its defaults are params.yaml's evaluate.decode)
SETTINGS = tuple(f.name for f in fields(DecodeSettings))


@dataclass(frozen=True)
class Step:
    """One reasoning step of an answer."""

    author: str  # draft | target
    text: str
    accepted: (
        bool | None
    )  # the draft's proposal kept (True), rewritten by the target (False); None: no proposal
    p: float | None = None  # the target probe's semantic probability (SemanticSpec)
    q: float | None = None  # the draft probe's
    tokens: int = 0  # the step's tokens in the target's tokenizer (the draft's for the draft alone)
    proposal: str | None = None  # the draft's rejected text, where the target rewrote it
    # why the target wrote the step: the rule's part that rejected the proposal (ratio, floor, target_rule,
    # token_check), or budget, empty, score (``models/spec/rules.REJECTED_BY``); None: nothing was judged
    rejected_by: str | None = None

    @classmethod
    def from_record(cls, record: StepRecord) -> Step:
        """The public view of a decoder's ``StepRecord``."""
        accepted = True if record.author == "draft" else (False if record.proposal is not None else None)
        tokens = record.target_tokens or record.draft_tokens
        return cls(
            record.author,
            record.text,
            accepted,
            record.p,
            record.q,
            tokens,
            record.proposal,
            record.rejected_by,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Generation:
    """One answer: the text, its steps, and what it cost."""

    text: str
    answer: str | None  # the final answer read from the text (\\boxed{...}, "the answer is ...")
    steps: list[Step]
    method: str
    output_tokens: int
    finish_reason: str  # eos | length
    seconds: float  # latency: from the prompt joining its batch to its last step
    target_share: float  # share of the output tokens the target wrote (the paper's Ratio)
    acceptance_rate: float | None  # accepted / proposed draft steps (None when nothing was proposed)
    result: DecodeResult = field(repr=False)  # the full trace (timings per activity, u draws, ...)

    @classmethod
    def from_result(cls, res: DecodeResult) -> Generation:
        """The public view of a ``DecodeResult``."""
        return cls(
            text=res.text,
            answer=res.answer,
            steps=[Step.from_record(s) for s in res.steps],
            method=res.method,
            output_tokens=res.output_tokens,
            finish_reason=res.finish_reason,
            seconds=res.timings.total,
            target_share=res.target_share,
            acceptance_rate=res.acceptance_rate,
            result=res,
        )

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per second of latency."""
        return self.output_tokens / self.seconds if self.seconds else 0.0


def check_settings(settings: dict[str, Any]) -> None:
    """ValueError naming any keyword that is not a decode setting."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; the settings are {list(SETTINGS)}")


def check_method(method: str, probe: str | None) -> None:
    """ValueError for an unknown method, or SemanticSpec on a handle loaded without probes."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    if method == PROBE_METHOD and probe is None:
        raise ValueError(
            "this handle was loaded with probe=None (baselines only): load it with a probe variant to "
            "decode with semanticspec"
        )


class SemanticSpec:
    """A model pair loaded once, with its probes; ``generate`` and ``stream`` decode with any method.

    Build it with :func:`semspec.load`. The decoders of each (method, settings) are built once and
    reused; they share the two models. A handle decodes one call at a time (calls from several threads
    are serialized); the server (``semspec serve``) batches concurrent requests instead."""

    def __init__(
        self,
        pair: PairConfig,
        lms: dict[str, LM],
        defaults: DecodeSettings,
        probe: str | None,
        probes_dir: Path | None,
        batch_size: int,
    ) -> None:
        self.pair, self.lms, self.defaults = pair, lms, defaults
        self.probe, self.probes_dir, self.batch_size = probe, probes_dir, batch_size
        self._decoders: dict[tuple, BatchDecoder] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        models = ", ".join(f"{r}={lm}" for r, lm in self.lms.items())
        return f"SemanticSpec(pair={self.pair.name!r}, probe={self.probe!r}, {models})"

    def settings(self, **overrides: Any) -> DecodeSettings:
        """The decode settings of a call: the evaluation's defaults with ``overrides`` (checked)."""
        check_settings(overrides)
        return replace(self.defaults, **overrides)

    def decoder(self, method: str = PROBE_METHOD, **overrides: Any) -> BatchDecoder:
        """The decoder of ``method`` under these settings, built once per (method, settings)."""
        from semspec.tasks.decoders import build_decoder

        check_method(method, self.probe)
        settings = self.settings(**overrides)
        key = (method, tuple(sorted((k, str(v)) for k, v in vars(settings).items())))
        if key not in self._decoders:
            dec = build_decoder(
                method, self.pair, self.lms, settings, self.probe or "all", probes_dir=self.probes_dir
            )
            if not isinstance(dec, BatchDecoder):
                raise ValueError(
                    f"method {method!r} decodes one prompt at a time; use generate() on one prompt"
                )
            self._decoders[key] = dec
        return self._decoders[key]

    def prompt_tokens(self, prompt: Prompt, max_new_tokens: int = 0) -> int:
        """The most tokens ``prompt`` takes in either model (rendered in each one's template), checked
        against each model's context window with room for ``max_new_tokens``: a ``ValueError`` says by how
        much it is over. The server calls it in a worker pool, before a request reaches the engine."""
        most = 0
        for role, lm in self.lms.items():
            n = len(lm.encode(lm.format_prompt(prompt)))
            window = lm.context_window
            if window is not None and n + max_new_tokens > window:
                raise ValueError(
                    f"the prompt takes {n} tokens in the {role} model; with max_tokens {max_new_tokens} that "
                    f"is above its context window of {window} tokens: shorten the prompt or max_tokens"
                )
            most = max(most, n)
        return most

    def generate(
        self, prompts: Prompt | Sequence[Prompt], method: str = PROBE_METHOD, **settings: Any
    ) -> Generation | list[Generation]:
        """Answer one prompt (a question, a list of chat messages, or ``semspec.RawPrompt`` text), or a
        list of prompts decoded together (continuous batching, ``batch_size`` rows at a time). Returns a
        :class:`Generation`, or a list in the prompts' order. ``settings``: see :data:`SETTINGS`."""
        many = isinstance(prompts, list | tuple) and not _is_chat(prompts)
        batch = list(prompts) if many else [prompts]
        if not batch:
            raise ValueError("no prompts given")
        with self._lock:
            if method in ("specsampling", "assisted"):  # token-level: one prompt at a time
                from semspec.tasks.decoders import build_decoder

                check_method(method, self.probe)
                dec = build_decoder(method, self.pair, self.lms, self.settings(**settings))
                results = [dec.decode(p) for p in batch]
            else:
                results = self.decoder(method, **settings).decode_batch(batch, self.batch_size)
        out = [Generation.from_result(r) for r in results]
        return out if many else out[0]

    def stream(self, prompt: Prompt, method: str = PROBE_METHOD, **settings: Any) -> Iterator[Step]:
        """Yield the steps of one answer as they are decided (accepted draft steps and the target's
        rewrites, in order). The decoding runs in a worker thread; an exception there is raised here."""
        dec = self.decoder(method, **settings)  # bad settings raise here, before the thread starts
        steps: queue.Queue = queue.Queue()
        done = object()

        def work() -> None:
            try:
                with self._lock:
                    dec.decode(prompt, on_step=lambda record: steps.put(Step.from_record(record)))
                steps.put(done)
            except BaseException as e:  # handed to the caller's thread
                steps.put(e)

        threading.Thread(target=work, name="semspec-stream", daemon=True).start()
        while (item := steps.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item


def _is_chat(prompts: Sequence[Any]) -> bool:
    """Whether ``prompts`` is one chat (a list of message mappings) rather than a list of prompts."""
    return bool(prompts) and all(isinstance(p, dict) and "role" in p for p in prompts)


def _champions_or_shipped(pair: PairConfig, probe: str) -> Path | None:
    """None when the local registry has champion ``probe`` probes of ``pair`` (decoding loads them); else
    the folder of probes that ships with semspec for the pair (``probes/<pair>/``), when it has them. The
    registry's error (or, without MLflow installed, how to get probes) is raised when neither does."""
    from semspec.models.project.probe_card import check_card
    from semspec.models.project.probe_folder import read_card, shipped_probes
    from semspec.tasks.decoders import check_probes

    try:
        check_probes(pair, probe, None)
        return None
    except (ValueError, ImportError) as e:
        shipped = shipped_probes(pair.name)
        if shipped is None or probe not in read_card(shipped).variants:
            if isinstance(e, ImportError):  # the core install: no MLflow, so no registry
                raise ValueError(
                    f"no {probe} probes ship for pair {pair.name!r} and MLflow is not installed: pass "
                    f"probes= an exported folder or Hub repo id, or install semspec[pipeline] and train them"
                ) from None
            raise
        check_card(read_card(shipped), pair, probe)
        log.info(
            "no champion %s probes of %s in the registry: decoding with the shipped ones in %s",
            probe,
            pair.name,
            shipped,
        )
        return shipped


def load(
    pair: str | Path | None = None,
    probes: str | Path | None = None,
    probe: str | None = "all",
    batch_size: int | None = None,
    params: str | Path | None = None,
) -> SemanticSpec:
    """Load a model pair for decoding.

    Args:
        pair: a pair name (``conf/pairs/<name>.yaml``) or a pair YAML path; default ``params.yaml``'s.
        probes: an exported probe folder (``semspec probes export``) or a Hub repo id (``org/name``,
            ``org/name@revision``); default: the local MLflow registry's ``champion`` versions.
        probe: the probe variant SemanticSpec uses (``all``, ``last``, ``mix``, ``random``;
            ``<variant>@<domain>`` for one domain's); None loads no probes (baselines only).
        batch_size: rows decoded together by ``generate`` on a list (default: ``evaluate.batch_size``).
        params: a params.yaml to read the defaults from (default: the project's).

    Every check (the pair file, the probes' presence and fit, the settings) runs before any model loads,
    and a failure is a ``ValueError`` saying what to do."""
    from semspec.models.lm import load_lm
    from semspec.models.project.pairs import load_pair
    from semspec.models.spec.names import split_probe_key
    from semspec.tasks.config import load_params
    from semspec.tasks.decoders import check_probes, decode_settings
    from semspec.tasks.environment import apply_env

    apply_env()  # the registry and caches under SEMSPEC_HOME, offline Hub settings
    cfg = load_params(params)
    pair_cfg = load_pair(pair or cfg.pair, None, cfg.split_strategy)
    probes_dir = None
    if probe is not None:
        split_probe_key(probe)  # a known variant, or variant@domain
        if probes is not None:
            from semspec.models.project.probe_folder import resolve_probes

            probes_dir = resolve_probes(probes)
            check_probes(pair_cfg, probe, probes_dir)
        else:
            probes_dir = _champions_or_shipped(pair_cfg, probe)
    elif probes is not None:
        raise ValueError("probes= names probes to load, and probe=None loads none: drop one of them")
    size = cfg.evaluate.batch_size if batch_size is None else batch_size
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {size}")
    defaults = decode_settings(cfg.evaluate)
    lms = {role: load_lm(pair_cfg.role(role)) for role in ROLES}
    log.info("loaded %s: %s", pair_cfg.name, ", ".join(f"{r} {lm}" for r, lm in lms.items()))
    return SemanticSpec(pair_cfg, lms, defaults, probe, probes_dir, size)
