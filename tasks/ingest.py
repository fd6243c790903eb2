"""Stage ``ingest``: questions -> reasoning chains -> prefixes (question + first k steps)."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from semspec.models.lm import LM, load_lm
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.settings import DecodeSettings
from semspec.models.spec.steps import joiner, split_steps
from semspec.tasks.config import IngestConfig, Params
from semspec.tasks.data import MAX_STEPS, Problem, build_prefixes, generate_arith
from semspec.tasks.decoders import build_decoder
from semspec.tasks.decontaminate import benchmark_ngrams, drop_benchmark_questions
from semspec.tasks.io import file_md5, write_parquet_atomic
from semspec.tasks.sources import BENCHMARKS, SOURCE_FILES, load_source, resolve_data_dir
from semspec.tasks.traces import TraceCache, trace_cache_path, write_traces_batched

log = logging.getLogger(__name__)

PREFIX_SCHEMA = pa.schema(
    [
        ("prefix_id", pa.string()),
        ("question_id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("step_index", pa.int32()),
        ("question", pa.string()),
        ("context", pa.string()),
    ]
)


def select_problems(cfg: IngestConfig) -> list[Problem]:
    """The questions to ingest: up to ``max_questions`` from each source (the generated arithmetic train
    split; s1K or a benchmark, filtered by domain, seeded shuffle), each with its domain (``domain_by``)."""
    out = []
    for name in cfg.sources():
        problems = _from_source(name, cfg)
        if cfg.domain_by == "source":
            problems = [replace(p, domain=name) for p in problems]
        out += problems
    return out


def _from_source(name: str, cfg: IngestConfig) -> list[Problem]:
    """Up to ``max_questions`` questions of one source."""
    if name == "arith":
        return generate_arith(cfg.max_questions, "train", seed=cfg.seed)
    problems = load_source(name, data_dir=cfg.data_dir, on_error=cfg.on_error)
    if name not in BENCHMARKS:  # training questions only: never an evaluation problem
        problems = drop_benchmark_questions(problems, benchmark_ngrams(cfg.data_dir), name)
    if cfg.domains and problems and all(p.domain == "unknown" for p in problems):
        raise ValueError(
            f"ingest: field 'domains' ({cfg.domains}) filters on s1K's 'cot_type' column, which this copy of "
            f"s1K does not have: remove ingest.domains, or use a copy with a 'cot_type' column"
        )
    if cfg.domains:
        problems = [p for p in problems if p.domain in cfg.domains]
        if not problems:
            raise ValueError(
                f"ingest: no {name} question has a domain in {cfg.domains} (a copy of s1K without cot_type "
                f"has only 'unknown')"
            )
    random.Random(cfg.seed).shuffle(problems)
    return problems[: cfg.max_questions]


def source_fingerprint(cfg: IngestConfig) -> str:
    """A fingerprint of the data ``select_problems`` reads: per source, the local file's MD5, the Hub id,
    or the generator (whose output is fixed by the config)."""
    return ",".join(_fingerprint(name, cfg) for name in cfg.sources())


def _fingerprint(name: str, cfg: IngestConfig) -> str:
    if name == "arith":
        return "generated:arith"
    local, hub = SOURCE_FILES[name]
    d = resolve_data_dir(cfg.data_dir)
    if d is None:
        return f"hub:{hub}"
    path = d / local
    return f"md5:{file_md5(path)}" if path.is_file() else f"missing:{path}"


def write_trace(lm: LM, question: str, max_tokens: int) -> str:
    """A greedy reasoning trace written by ``lm``, step by step, within ``max_tokens``."""
    state = lm.prefill(lm.format_prompt(question))
    text, used = "", 0
    while used < max_tokens:
        step = lm.generate_step(
            state, n=1, temperature=0.0, max_tokens=min(lm.config.max_step_tokens, max_tokens - used)
        )[0]
        used += step.num_tokens
        if step.text:
            text += step.text
            state = lm.prefill(step.text, state)
        if step.finish_reason == "eos" or not step.text:
            break
    return text


TRACE_VARIANT = "all"  # the probes the semanticspec author decodes with (the registered champions)


def semanticspec_writer(pair: PairConfig, lms: dict[str, LM], max_tokens: int) -> Callable[[str], str]:
    """A function question -> the chain the SemanticSpec decoder writes for it (greedy, within
    ``max_tokens``, with the pair's champion probes of ``TRACE_VARIANT``). A pair without registered
    probes is a ``ValueError`` that says how to train them."""
    settings = DecodeSettings(max_new_tokens=max_tokens, temperature=0.0)
    try:
        decoder = build_decoder("semanticspec", pair, lms, settings, TRACE_VARIANT)
    except ValueError as err:
        raise ValueError(
            f"ingest: trace_author 'semanticspec' decodes with the pair's registered probes: {err}"
        ) from None
    return lambda question: decoder.decode(question).text


def run_ingest(cfg: IngestConfig, pair: PairConfig, out_path: Path, writer: LM | None = None) -> Path:
    """Build ``prefixes.parquet`` at ``out_path``, splitting chains into steps as the pair's models end
    them (``split_strategy``, set by ``load_pair``). Each author of ``trace_author`` gives every question
    one chain (several authors: mixed contexts; the first author's prefixes are the ones it gives alone,
    the others' have ids of their own). ``writer`` (default: the model an author names, or the target
    with ``generate_traces``, loaded on demand) writes the traces the data does not give; the
    ``semanticspec`` author decodes with both models and the registered probes (``semanticspec_writer``)."""
    authors = cfg.trace_authors()
    problems = select_problems(cfg)
    cache = TraceCache(trace_cache_path(out_path), cfg, pair)
    write, lm_of = trace_writer(cfg, pair, writer)
    write_traces_batched(cfg, problems, authors, cache, lm_of)
    rows, counts = prefix_rows(cfg, pair, problems, authors, cache.wrapping(write))
    if not rows:
        raise ValueError(f"ingest produced no prefixes from {len(problems)} question(s)")
    log.info(
        "ingest: %d prefixes from %d questions x %d author(s) (%d traces generated, %d chains of %d+ steps "
        "dropped, %d empty)",
        len(rows),
        len(problems),
        len(authors),
        counts["generated"],
        counts["too_long"],
        MAX_STEPS,
        counts["no_chain"],
    )
    return write_parquet_atomic(pa.Table.from_pylist(rows, schema=PREFIX_SCHEMA), out_path)


def trace_writer(
    cfg: IngestConfig, pair: PairConfig, writer: LM | None = None
) -> tuple[Callable[[str, str], str], Callable[[str], LM]]:
    """A function (model, question) -> the chain that model writes within ``trace_max_tokens``, and the
    function role -> its model (loaded on first use, shared by both): a role's greedy trace (``write_trace``; the role's model, or ``writer`` when given, loaded on first use and kept),
    or for ``semanticspec`` the SemanticSpec decoder's chain (built on first use, with both models)."""
    writers: dict[str, LM] = {}
    decoded: list[Callable[[str], str]] = []  # the semanticspec author's writer, built on first use

    def lm(model: str) -> LM:
        if model not in writers:
            writers[model] = writer or load_lm(pair.role(model))
        return writers[model]

    def write(model: str, question: str) -> str:
        if model == "semanticspec":
            if not decoded:
                lms = {role: lm(role) for role in ("draft", "target")}
                decoded.append(semanticspec_writer(pair, lms, cfg.trace_max_tokens))
            return decoded[0](question)
        return write_trace(lm(model), question, cfg.trace_max_tokens)

    return write, lm


def prefix_rows(
    cfg: IngestConfig,
    pair: PairConfig,
    problems: list[Problem],
    authors: list[str],
    write: Callable[[str, str], str],
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The prefix rows of every question's chain by every author, and the counts the stage logs: traces
    ``generated``, chains dropped as ``too_long`` (``MAX_STEPS`` steps or more) and ``no_chain`` (empty)."""
    split = pair.target.split
    after = joiner(split, pair.target.delimiter)  # what follows each step of a context
    # the first author's prefixes are drawn and named as when it writes alone; the others' apart
    rngs = {a: random.Random(cfg.seed if i == 0 else f"{cfg.seed}:{a}") for i, a in enumerate(authors)}
    rows: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    for prob in tqdm(problems, desc="ingest", unit="question"):
        for author in authors:
            steps, generated = _chain_steps(cfg, prob, author, split, write)
            counts["generated"] += generated
            if not steps or len(steps) >= MAX_STEPS:
                counts["no_chain"] += not steps
                counts["too_long"] += bool(steps)
                continue
            chain_id = "" if author == authors[0] else author
            prefixes = build_prefixes(  # another author's k = 0 is the question alone: the first one's
                prob,
                steps,
                cfg.max_prefixes_per_question,
                after,
                rng=rngs[author],
                chain=chain_id,
                first=int(bool(chain_id)),
            )
            rows.extend(asdict(p) for p in prefixes)
    return rows, counts


def _chain_steps(
    cfg: IngestConfig, prob: Problem, author: str, split: str, write: Callable[[str, str], str]
) -> tuple[list[str], bool]:
    """The steps of ``author``'s chain for one question, and whether a model wrote it now: ``data`` gives the
    data's trace (written by the target with ``generate_traces`` where there is none), else the reference
    solution's steps; any other author writes its chain."""
    model = author if author != "data" else ("target" if cfg.generate_traces else None)
    chain = prob.trace if author == "data" else None
    generated = False
    if chain is None and model is not None:
        chain = write(model, prob.question)
        generated = True
    steps = split_steps(chain or "", split)
    if not steps and author == "data":  # a model's empty chain is not the solution's
        steps = split_steps(prob.solution, split)
    return steps, generated


def stage(*, params: Params, pair: PairConfig, out: Path) -> str:
    """Stage ingest (the CLI's and dvc.yaml's entry): questions -> reasoning steps -> ``out``."""
    return f"wrote {run_ingest(params.ingest, pair, out)}"
