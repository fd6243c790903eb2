"""Semantic-equivalence judges and greedy clustering of sampled steps.

Two judges share one interface (:meth:`Judge.cluster`):

* :class:`NLIJudge` — an MNLI sequence classifier doing bidirectional entailment (the paper's
  DeBERTa-MNLI). ``strict``: a ~ b iff a entails b and b entails a. ``lenient``: neither direction is a
  contradiction and not both are neutral. Label ids come from the model's ``id2label``.
* :class:`EmbeddingJudge` — sentence embeddings (MiniLM offline): a ~ b iff their cosine is at least
  the threshold, or the texts match after normalising whitespace and numbers.

Clustering follows the paper: each sample joins the first cluster whose representative (its first
member) it is equivalent to, else starts a new cluster.

Long contexts: a judge that reads the question and prefix with each step (``cluster.with_question``) must
still see every step whole. Each side is cut to the judge's window by dropping the *start* of the context
(its end, nearest the step, is kept); a step that alone does not fit is not judged (``None``: the stage
counts it as invalid). Truncated contexts are counted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from semspec.models.lm import pick_device
from semspec.models.lm.pair import JudgeConfig
from semspec.models.lm.weights import resolve_path, verify_sha256


def normalize_step(text: str) -> str:
    """Lower-case, collapse whitespace, drop thousands separators and trailing zeros of decimals."""
    t = text.strip().lower()
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)
    t = re.sub(r"(\d+)\.0+\b", r"\1", t)
    t = re.sub(r"(\d+\.\d*?)0+\b", r"\1", t)
    return re.sub(r"\s+", " ", t)


def greedy_cluster(n: int, equivalent: Callable[[int, list[int]], list[bool]]) -> list[int]:
    """Cluster ids for items 0..n-1: item i joins the first cluster whose representative it is
    equivalent to (``equivalent(i, reps)`` judges i against every representative at once)."""
    reps: list[int] = []
    ids: list[int] = []
    for i in range(n):
        hits = equivalent(i, reps) if reps else []
        j = next((k for k, h in enumerate(hits) if h), None)
        if j is None:
            reps.append(i)
            j = len(reps) - 1
        ids.append(j)
    return ids


def semantic_entropy(cluster_ids: Sequence[int]) -> float:
    """-sum_c p_c log p_c over cluster frequencies."""
    n = len(cluster_ids)
    if n == 0:
        return float("nan")
    counts: dict[int, int] = {}
    for c in cluster_ids:
        counts[c] = counts.get(c, 0) + 1
    return -sum((k / n) * math.log(k / n) for k in counts.values())


@dataclass
class Clustering:
    """Cluster ids of one prefix's steps (None: the step alone exceeds the judge's window) and how many
    sides had their context cut to fit."""

    ids: list[int | None]
    truncated: int = 0


def fit_context(tokenizer, context: str, step: str, budget: int) -> tuple[str | None, bool]:
    """``context + step`` in at most ``budget`` tokens, dropping the context's start (whole tokens, cut
    at a token's first character); returns the text and whether the context was cut, or ``(None, False)``
    when the step alone does not fit."""
    n_step = len(tokenizer(step, add_special_tokens=False)["input_ids"])
    if n_step > budget:
        return None, False
    if not context:
        return step, False
    enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    room, n = budget - n_step, len(enc["input_ids"])
    if n <= room:
        return context + step, False
    if room == 0:
        return step, True
    return context[enc["offset_mapping"][n - room][0] :] + step, True


class Judge:
    """Common interface: cluster the texts of one prefix."""

    def cluster(self, texts: list[str], premise: str = "") -> Clustering:
        """Cluster ids for ``texts`` (the valid samples of one prefix); ``premise`` is read before each
        step when the judge is configured to use the question/prefix (cut from its start to fit)."""
        raise NotImplementedError

    def _fit(self, texts: list[str], premise: str) -> tuple[list[str | None], int]:
        """Each side as the judge reads it (None: the step does not fit) and the number cut."""
        budget = self.side_budget()
        if budget is None or self.tokenizer is None:
            return [premise + t for t in texts], 0
        fitted = [fit_context(self.tokenizer, premise, t, budget) for t in texts]
        return [text for text, _ in fitted], sum(cut for _, cut in fitted)

    def side_budget(self) -> int | None:
        """Tokens one side may take (None: no limit known)."""
        return None

    tokenizer = None


def _cluster_fitting(
    sides: list[str | None], equivalent: Callable[[int, list[int]], list[bool]]
) -> list[int | None]:
    """``greedy_cluster`` over the sides that fit (indices into ``sides``); None for the others."""
    keep = [i for i, side in enumerate(sides) if side is not None]
    ids = greedy_cluster(len(keep), lambda j, reps: equivalent(keep[j], [keep[r] for r in reps]))
    out: list[int | None] = [None] * len(sides)
    for i, c in zip(keep, ids, strict=True):
        out[i] = c
    return out


_MARGIN = 2  # tokens kept free per side: a context and a step tokenised together may merge or split one


_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in a step (its result, in most arithmetic steps), normalised."""
    nums = _NUM_RE.findall(normalize_step(text))
    return nums[-1] if nums else None


class EmbeddingJudge(Judge):
    """Cosine similarity of sentence embeddings, plus exact match after normalisation.

    With ``numbers_must_match``, two steps that both contain numbers must also end on the same number:
    sentence embeddings barely see the difference between "= 84" and "= 85".
    """

    def __init__(
        self,
        encode: Callable[[list[str]], torch.Tensor],
        threshold: float = 0.9,
        numbers_must_match: bool = False,
        tokenizer=None,
        window: int | None = None,
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.encode = encode  # texts -> (N, E) embeddings
        self.threshold = threshold
        self.numbers_must_match = numbers_must_match
        self.tokenizer, self.window = tokenizer, window  # word pieces the encoder reads (MiniLM: 256)

    def side_budget(self) -> int | None:
        """The encoder's window less [CLS], [SEP] and a margin."""
        return None if self.window is None else self.window - 2 - _MARGIN

    def numbers_agree(self, a: str, b: str) -> bool:
        """False only when the number rule is on and the steps end on different numbers."""
        if not self.numbers_must_match:
            return True
        na, nb = last_number(a), last_number(b)
        return na is None or nb is None or na == nb

    def similarity(self, texts: list[str]) -> torch.Tensor:
        """(N, N) cosine similarities."""
        emb = torch.nn.functional.normalize(self.encode(texts).float(), dim=-1)  # (N, E)
        return emb @ emb.T

    def cluster(self, texts: list[str], premise: str = "") -> Clustering:
        if not texts:
            return Clustering([])
        sides, truncated = self._fit(texts, premise)
        keep = [i for i, side in enumerate(sides) if side is not None]
        emb = self.similarity([sides[i] for i in keep]) if keep else torch.empty(0, 0)  # (K, K)
        row = {i: k for k, i in enumerate(keep)}
        norm = [normalize_step(t) for t in texts]

        def equivalent(i: int, reps: list[int]) -> list[bool]:
            return [
                norm[i] == norm[r]
                or (float(emb[row[i], row[r]]) >= self.threshold and self.numbers_agree(texts[i], texts[r]))
                for r in reps
            ]

        return Clustering(_cluster_fitting(sides, equivalent), truncated)


class NLIJudge(Judge):
    """Bidirectional entailment with an MNLI classifier (labels read from ``id2label``)."""

    def __init__(self, model, tokenizer, mode: str = "strict", batch_size: int = 32) -> None:
        if mode not in ("strict", "lenient"):
            raise ValueError(f"mode must be 'strict' or 'lenient', got {mode!r}")
        self.model, self.tokenizer, self.mode, self.batch_size = model.eval(), tokenizer, mode, batch_size
        positions = getattr(model.config, "max_position_embeddings", None)
        limits = [v for v in (getattr(tokenizer, "model_max_length", None), positions) if v and v < 10**6]
        self.max_length: int | None = min(limits) if limits else None
        labels = {str(v).lower(): int(k) for k, v in model.config.id2label.items()}
        try:
            self.entail = next(i for name, i in labels.items() if name.startswith("entail"))
            self.contra = next(i for name, i in labels.items() if name.startswith("contra"))
            self.neutral = next(i for name, i in labels.items() if name.startswith("neutral"))
        except StopIteration:
            raise ValueError(
                f"NLI model labels {model.config.id2label} must name entailment, neutral and contradiction"
            ) from None

    @torch.inference_mode()
    def predict(self, pairs: list[tuple[str, str]]) -> torch.Tensor:
        """Predicted label id for each (premise, hypothesis) pair, batched. -> (P,)"""
        out = []
        device = next(self.model.parameters()).device
        for i in range(0, len(pairs), self.batch_size):
            chunk = pairs[i : i + self.batch_size]
            enc = self.tokenizer(
                [a for a, _ in chunk],
                [b for _, b in chunk],
                padding=True,
                truncation=True,
                return_tensors="pt",
            ).to(device)
            out.append(self.model(**enc).logits.argmax(dim=-1).cpu())  # (B,)
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

    def decide(self, ab: int, ba: int) -> bool:
        """Equivalence from the two directions' labels."""
        if self.mode == "strict":
            return ab == self.entail and ba == self.entail
        return self.contra not in (ab, ba) and not (ab == self.neutral and ba == self.neutral)

    def equivalent_pairs(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """Symmetric equivalence for each (a, b): both directions judged in one batch."""
        labels = self.predict(pairs + [(b, a) for a, b in pairs]).tolist()
        n = len(pairs)
        return [self.decide(labels[i], labels[n + i]) for i in range(n)]

    def side_budget(self) -> int | None:
        """Half of the classifier's window less its special tokens and a margin: both sides fit whole."""
        if self.max_length is None:
            return None
        return (self.max_length - self.tokenizer.num_special_tokens_to_add(pair=True)) // 2 - _MARGIN

    def cluster(self, texts: list[str], premise: str = "") -> Clustering:
        sides, truncated = self._fit(texts, premise)
        ids = _cluster_fitting(
            sides, lambda i, reps: self.equivalent_pairs([(sides[i], sides[r]) for r in reps])
        )
        return Clustering(ids, truncated)


def load_labelled_pairs(path: Path) -> list[tuple[bool, str, str]]:
    """Labelled step pairs ``(equivalent, a, b)`` from a calibration YAML (``pairs: [[true, a, b], ...]``)."""
    try:
        rows = (yaml.safe_load(path.read_text(encoding="utf-8")) or {})["pairs"]
        return [(bool(x[0]), str(x[1]), str(x[2])) for x in rows]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path}: expected `pairs: [[true|false, step, step], ...]` ({e})") from None


def calibrate(
    judge: EmbeddingJudge, pairs: list[tuple[bool, str, str]], thresholds: list[float]
) -> list[dict]:
    """Accuracy, precision, recall and F1 of ``judge`` on labelled step pairs, per cosine threshold."""
    texts = [t for _, a, b in pairs for t in (a, b)]
    sim = judge.similarity(texts)  # (2P, 2P)
    rows = []
    for th in thresholds:
        tp = fp = fn = tn = 0
        for k, (label, a, b) in enumerate(pairs):
            pred = normalize_step(a) == normalize_step(b) or (
                float(sim[2 * k, 2 * k + 1]) >= th and judge.numbers_agree(a, b)
            )
            tp, fp, fn, tn = (
                tp + (pred and label),
                fp + (pred and not label),
                fn + (label and not pred),
                tn + (not pred and not label),
            )
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
        rows.append(
            {"threshold": th, "accuracy": (tp + tn) / len(pairs), "precision": prec, "recall": rec, "f1": f1}
        )
    return rows


def load_judge(judge_cfg: JudgeConfig) -> Judge:
    """Build the judge a pair's config names (Hub id, local folder, or a package that ships it)."""
    where = resolve_path(judge_cfg.source, judge_cfg.path)
    if judge_cfg.sha256:  # never load weights that are not the pinned ones
        verify_sha256(Path(where) / judge_cfg.weights_file, judge_cfg.sha256, judge_cfg.model_id)
    device = pick_device(judge_cfg.device)
    if judge_cfg.kind == "embedding":
        from sentence_transformers import SentenceTransformer  # heavy; NLI judges never need it

        st = SentenceTransformer(where, device=str(device), trust_remote_code=judge_cfg.trust_remote_code)

        def encode(texts: list[str]) -> torch.Tensor:
            return st.encode(
                texts, batch_size=judge_cfg.batch_size, convert_to_tensor=True, show_progress_bar=False
            ).cpu()

        return EmbeddingJudge(
            encode, judge_cfg.threshold, judge_cfg.numbers_must_match, st.tokenizer, st.max_seq_length
        )
    tok = AutoTokenizer.from_pretrained(where, trust_remote_code=judge_cfg.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        where, trust_remote_code=judge_cfg.trust_remote_code
    )
    return NLIJudge(model.to(device), tok, judge_cfg.nli_mode, judge_cfg.batch_size)
