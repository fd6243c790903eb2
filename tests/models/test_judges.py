"""Judges and clustering: bidirectional NLI with labels from id2label, embeddings, greedy clusters."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

from semspec.models.spec.judges import (
    EmbeddingJudge,
    NLIJudge,
    greedy_cluster,
    normalize_step,
    semantic_entropy,
)
from tests.helpers.tiny import char_tokenizer


class StubNLI(torch.nn.Module):
    """An MNLI 'model' whose label comes from a lookup on (premise, hypothesis)."""

    def __init__(self, id2label: dict[int, str], table: dict[tuple[str, str], str], tok) -> None:
        super().__init__()
        self.config = SimpleNamespace(id2label=id2label)
        self.table, self.tok = table, tok
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.label2id = {v: k for k, v in id2label.items()}
        self.calls: list[tuple[str, str]] = []

    def forward(self, input_ids, **kw):
        logits = torch.zeros(input_ids.shape[0], len(self.label2id))
        for b in range(input_ids.shape[0]):
            a, h = self._pair(input_ids[b])
            self.calls.append((a, h))
            neutral = next(v for v in self.label2id if v.lower() == "neutral")
            logits[b, self.label2id[self.table.get((a, h), neutral)]] = 5.0
        return SimpleNamespace(logits=logits)

    def _pair(self, ids):
        text = self.tok.decode(ids, skip_special_tokens=False).replace("<pad>", "")
        a, h = text.replace("<s>", "").split("</s>")[:2]
        return a, h


def _tok():
    from tokenizers import processors

    tok = char_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return tok


@pytest.mark.parametrize(
    "order", [("CONTRADICTION", "NEUTRAL", "ENTAILMENT"), ("entailment", "neutral", "contradiction")]
)
def test_nli_reads_labels_from_id2label(order):
    tok = _tok()
    id2label = dict(enumerate(order))
    table = {
        ("a", "b"): "ENTAILMENT",
        ("b", "a"): "ENTAILMENT",
        ("a", "c"): "ENTAILMENT",
        ("c", "a"): "NEUTRAL",
    }
    table = {k: next(n for n in order if n.lower() == v.lower()) for k, v in table.items()}
    judge = NLIJudge(StubNLI(id2label, table, tok), tok, mode="strict")
    assert judge.equivalent_pairs([("a", "b"), ("a", "c"), ("b", "c")]) == [True, False, False]
    assert judge.cluster(["a", "b", "c"]).ids == [0, 0, 1]


def test_nli_lenient_mode():
    tok = _tok()
    id2label = {0: "ENTAILMENT", 1: "NEUTRAL", 2: "CONTRADICTION"}
    table = {
        ("a", "c"): "ENTAILMENT",
        ("c", "a"): "NEUTRAL",
        ("a", "d"): "CONTRADICTION",
        ("d", "a"): "ENTAILMENT",
    }
    judge = NLIJudge(StubNLI(id2label, table, tok), tok, mode="lenient")
    # entail + neutral: equivalent; contradiction either way: not; neutral both ways: not
    assert judge.equivalent_pairs([("a", "c"), ("a", "d"), ("x", "y")]) == [True, False, False]


def test_nli_rejects_models_without_mnli_labels():
    tok = _tok()
    with pytest.raises(ValueError, match="entailment"):
        NLIJudge(StubNLI({0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}, {}, tok), tok)


def test_tiny_deberta_judge_is_symmetric_and_batched():
    tok = _tok()
    model = _tiny_deberta(tok, layers=2)
    texts = ["x = 3 + 4 = 7", "so we get 7", "the total is 12", "add them: 3+4", "7 apples"]
    judges = {m: NLIJudge(model, tok, mode=m, batch_size=3) for m in ("strict", "lenient")}
    pairs = [(a, b) for a in texts for b in texts if a != b]
    for judge in judges.values():
        assert (judge.entail, judge.contra, judge.neutral) == (2, 1, 0)
        ab = judge.equivalent_pairs(pairs)
        ba = judge.equivalent_pairs([(b, a) for a, b in pairs])
        assert ab == ba, "bidirectional judgement must not depend on the order of the pair"
        ids = judge.cluster(texts, premise="Q: 3+4?\n").ids
        assert len(ids) == len(texts) and ids[0] == 0


def test_embedding_judge_threshold_and_exact_match():
    vecs = {
        "a": [1.0, 0.0],
        "a'": [0.99, 0.14],
        "b": [0.0, 1.0],
        "The total is 1,000.0": [0.5, -1.0],
        "the  total is 1000": [-0.5, 1.0],
    }
    judge = EmbeddingJudge(lambda ts: torch.tensor([vecs[t] for t in ts]), threshold=0.95)
    assert judge.cluster(["a", "a'", "b"]).ids == [0, 0, 1]
    assert EmbeddingJudge(judge.encode, threshold=0.999).cluster(["a", "a'", "b"]).ids == [0, 1, 2]
    # different embeddings, same text after normalising case, spaces and numbers
    assert judge.cluster(["The total is 1,000.0", "the  total is 1000"]).ids == [0, 0]
    with pytest.raises(ValueError, match="threshold"):
        EmbeddingJudge(judge.encode, threshold=0)


def test_greedy_cluster_uses_first_matching_representative():
    # equivalence by parity; each item compares against the representatives only
    seen = []

    def eq(i, reps):
        seen.append((i, tuple(reps)))
        return [i % 2 == r % 2 for r in reps]

    assert greedy_cluster(5, eq) == [0, 1, 0, 1, 0]
    assert seen[-1] == (4, (0, 1))


def test_semantic_entropy_and_normalisation():
    assert semantic_entropy([0, 0, 0, 0]) == 0
    assert semantic_entropy([0, 1]) == pytest.approx(math.log(2))
    assert math.isnan(semantic_entropy([]))
    assert normalize_step("  So  X = 3.50\n") == "so x = 3.5"


def _tiny_deberta(tok, positions: int = 128, layers: int = 1):
    cfg = DebertaV2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=positions,
        num_labels=3,
        pad_token_id=0,
        id2label={0: "NEUTRAL", 1: "CONTRADICTION", 2: "ENTAILMENT"},
        label2id={"NEUTRAL": 0, "CONTRADICTION": 1, "ENTAILMENT": 2},
    )
    torch.manual_seed(0)
    return DebertaV2ForSequenceClassification(cfg).eval()


def test_a_long_context_never_cuts_the_steps_away():
    """A 2,000-token question+prefix: both steps still reach the classifier whole, as two different
    inputs (before, truncation cut the steps off both sides and every pair looked the same)."""
    tok = _tok()
    model = _tiny_deberta(tok)
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kw: seen.extend(kw["input_ids"].tolist()), with_kwargs=True
    )
    judge = NLIJudge(model, tok, batch_size=8)
    context = "Question: " + "the long story goes on. " * 84  # ~2,000 characters = tokens here
    steps = ["Step: x = 3 + 4 = 7.", "Step: the answer is 12!"]
    found = judge.cluster(steps, premise=context)
    assert found.truncated == 2 and all(c is not None for c in found.ids)
    texts = {tok.decode(ids, skip_special_tokens=True) for ids in seen}
    assert len(texts) == 2, "the two directions of one pair: two different inputs"
    for text in texts:
        assert steps[0] in text and steps[1] in text
        assert "the long story goes on" in text  # the context's end is kept
    assert max(len([i for i in ids if i != 0]) for ids in seen) <= 128


def test_a_step_longer_than_the_window_is_not_judged():
    tok = _tok()
    judge = NLIJudge(_tiny_deberta(tok, positions=64), tok)
    found = judge.cluster(["short step", "x" * 200, "another step"], premise="Q: ")
    assert found.ids[1] is None and found.ids[0] == 0 and found.ids[2] is not None


def test_embedding_judge_fits_its_window_the_same_way():
    tok = _tok()
    encoded = []

    def encode(texts):
        encoded.extend(texts)
        return torch.stack([torch.tensor([float(len(t)), 1.0]) for t in texts])

    judge = EmbeddingJudge(encode, threshold=0.5, tokenizer=tok, window=40)
    found = judge.cluster(["a = 1", "b = 22", "y" * 60], premise="long context " * 20)
    assert found.ids[2] is None and found.truncated == 2
    assert all(len(t) <= 40 and t.endswith(("a = 1", "b = 22")) for t in encoded)


def test_judge_weights_are_checked_against_the_pinned_sha256_before_loading(tmp_path):
    from semspec.models.lm.pair import JudgeConfig
    from semspec.models.spec.judges import load_judge

    (tmp_path / "model.safetensors").write_bytes(b"not the weights the pair file pins")
    model_cfg = JudgeConfig(
        kind="embedding", model_id="minilm", source="local", path=str(tmp_path), sha256="ab" * 32
    )
    with pytest.raises(ValueError, match=r"minilm: sha256 of .*model\.safetensors"):
        load_judge(model_cfg)
    with pytest.raises(ValueError, match="sha256"):
        JudgeConfig(kind="embedding", source="local", path=str(tmp_path), sha256="not-hex")
