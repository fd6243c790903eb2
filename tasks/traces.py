"""The chains a model writes for ingest, batched and kept: ``write_traces_batched`` has each model author
write its chains ``TRACE_BATCH`` questions at a time, and :class:`TraceCache` keeps every chain on disk as
it is written, so a killed ingest resumes at the first chain it had not written."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from semspec.models.lm import LM
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.batching import SingleModelDecoder, decode_all
from semspec.models.spec.names import ROLES
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import IngestConfig
from semspec.tasks.data import Problem

log = logging.getLogger(__name__)


def trace_cache_path(out_path: Path) -> Path:
    """Where the stage keeps the traces it wrote (``<out>.traces.jsonl``), so a killed run resumes."""
    return out_path.with_name(out_path.name + ".traces.jsonl")


class TraceCache:
    """The traces the stage wrote, appended to a JSON-lines file as each is written and read back by a
    later run instead of written again: generating chains is most of the stage's time, and a run killed
    after hours resumes at the first chain it had not finished. A trace's key names the author's model,
    the token budget and the question, so a changed model or budget writes anew."""

    def __init__(self, path: Path, cfg: IngestConfig, pair: PairConfig) -> None:
        self.path, self.cfg, self.pair = path, cfg, pair
        self.done: dict[str, str] = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the line a kill cut short
                    continue
                self.done[row["key"]] = row["text"]
            log.info("ingest: %d traces already written (%s)", len(self.done), path)

    def key(self, model: str, question: str) -> str:
        """The key of ``model``'s trace of ``question``: the model, what shapes its text (its file, prompt,
        system prompt, template, step delimiter and budget, the split) and the token budget."""
        model_cfg = self.pair.role(model)
        shaping = [getattr(model_cfg, name, None) for name in TRACE_SHAPING]
        text = json.dumps([model_cfg.model_id, shaping, self.cfg.trace_max_tokens, question])
        return hashlib.sha1(text.encode()).hexdigest()

    def __contains__(self, item: tuple[str, str]) -> bool:
        return self.key(*item) in self.done

    def put(self, model: str, question: str, text: str) -> None:
        """Keep ``text`` as ``model``'s trace of ``question``, on disk at once."""
        k = self.key(model, question)
        self.done[k] = text
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+", encoding="utf-8") as f:
            f.seek(0, 2)
            if f.tell() and not self._ends_a_line(f):  # the line a kill cut short ends here
                f.write("\n")
            f.write(json.dumps({"key": k, "model": model, "text": text}) + "\n")

    @staticmethod
    def _ends_a_line(f) -> bool:
        f.seek(f.tell() - 1)
        return f.read(1) == "\n"

    def wrapping(self, write: Callable[[str, str], str]) -> Callable[[str, str], str]:
        """``write`` that reads a kept trace instead of writing it again, and keeps what it writes."""

        def cached(model: str, question: str) -> str:
            if model not in ROLES:  # the semanticspec author's chains depend on probes: never kept
                return write(model, question)
            if (model, question) not in self:
                self.put(model, question, write(model, question))
            return self.done[self.key(model, question)]

        return cached


TRACE_BATCH = 8  # questions a model writes its chains for at once (greedy, continuous batching)
# what of a model's config shapes the chains it writes, besides its id (a trace's key holds them)
TRACE_SHAPING = (
    "sha256", "gguf_file", "dtype", "prompt", "plain_template", "system_prompt", "delimiter",
    "max_step_tokens", "split",
)  # fmt: skip


def write_traces_batched(
    cfg: IngestConfig,
    problems: list[Problem],
    authors: list[str],
    cache: TraceCache,
    lm_of: Callable[[str], LM],
) -> None:
    """Every chain a model author (``draft``, ``target``, or ``data`` with ``generate_traces``) still owes,
    written ``TRACE_BATCH`` questions at a time (``write_chains``, the batched greedy step decoder) and kept
    in ``cache`` as each finishes, several times faster than one question at a time. Its chains are the
    greedy steps the decoders write; ``write_trace`` (one question, each step re-read as text) may differ
    from them by a token where a step's text tokenizes otherwise when read back."""
    for author in authors:
        model = (
            author if author in ROLES else ("target" if author == "data" and cfg.generate_traces else None)
        )
        if model is None:
            continue
        todo = [
            p.question
            for p in problems
            if (author != "data" or p.trace is None) and (model, p.question) not in cache
        ]
        if not todo:
            continue
        with tqdm(total=len(todo), desc=f"ingest: {model} chains", unit="chain") as bar:

            def keep(i: int, text: str, model: str = model, bar: tqdm = bar, todo: list[str] = todo) -> None:
                cache.put(model, todo[i], text)
                bar.update()

            write_chains(lm_of(model), model, todo, cfg.trace_max_tokens, keep)


def write_chains(
    lm: LM, role: str, questions: list[str], max_tokens: int, keep: Callable[[int, str], None]
) -> None:
    """``lm``'s greedy chains of ``questions`` (within ``max_tokens`` each), ``TRACE_BATCH`` at a time;
    ``keep(i, text)`` sees each as its row finishes."""
    settings = DecodeSettings(max_new_tokens=max_tokens, temperature=0.0)
    decoder = SingleModelDecoder(lm, settings, role)
    decode_all(decoder, questions, TRACE_BATCH, on_result=lambda i, res: keep(i, res.text))
