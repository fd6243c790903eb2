"""The real embedded pair (GGUF models shipped in PyPI packages): shapes, stopping and pooling."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.embedded

QUESTION = "Tom has 3 apples and buys 5 more. He gives away 2. How many apples does he have?"


@pytest.mark.parametrize("role, layers, hidden", [("draft", 30, 576), ("target", 18, 640)])
def test_shapes(request, role, layers, hidden):
    lm = request.getfixturevalue(f"{role}_lm")
    assert (lm.num_layers, lm.hidden_size) == (layers, hidden)


# Pooling while generating vs prefilling the same step: float32 agrees to rounding; bfloat16 (the draft)
# accumulates one token vs a whole step differently, so it is held to a mean relative error and cosine.
@pytest.mark.parametrize("role", ["draft", "target"])
def test_generation_pooling_equals_prefill_pooling(request, role):
    import torch

    lm = request.getfixturevalue(f"{role}_lm")
    state = lm.prefill(lm.format_prompt(QUESTION))
    s = lm.generate_step(state, n=1, temperature=0.0, max_tokens=24)[0]
    sc = lm.score_step(state, s.text)
    assert sc.token_ids == s.token_ids
    for feat in ("last", "all"):
        a, b = s.pooled.feature(feat).float(), sc.pooled.feature(feat).float()
        if lm.spec.dtype == "float32":
            rel = float((a - b).abs().max() / a.abs().mean())
            assert rel < 1e-3, f"{role}/{feat}: relative pooling difference {rel:.2e}"
        else:
            rel = float((a - b).abs().mean() / a.abs().mean())
            cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
            assert rel < 3e-2 and cos > 0.999, (
                f"{role}/{feat}: mean relative difference {rel:.2e}, cosine {cos:.5f}"
            )


def test_draft_batched_samples_stop_at_the_delimiter(draft_lm):
    samples = draft_lm.generate_step(draft_lm.format_prompt(QUESTION), n=8, max_tokens=40, seed=0)
    assert len(samples) == 8
    for s in samples:
        if s.finish_reason == "delimiter":
            assert s.text.endswith("\n\n") and "\n\n" not in s.text[:-2]
        elif s.finish_reason == "length":
            assert s.num_tokens == 40
    assert any(s.finish_reason == "delimiter" for s in samples)
