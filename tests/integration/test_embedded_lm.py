"""The real embedded pair (GGUF models shipped in PyPI packages): shapes, stopping and pooling."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.embedded

QUESTION = "Tom has 3 apples and buys 5 more. He gives away 2. How many apples does he have?"


@pytest.mark.parametrize("role, layers, hidden", [("draft", 30, 576), ("target", 18, 640)])
def test_shapes(request, role, layers, hidden):
    lm = request.getfixturevalue(f"{role}_lm")
    assert (lm.num_layers, lm.hidden_size) == (layers, hidden)


# Pooling while generating vs prefilling the same step: float32 agrees to rounding; bfloat16 accumulates
# one token vs a whole step differently (0.5% measured here), so it is held to a mean relative error and
# cosine. The int formats decode through their int kernels and prefill (more than a few rows) through a
# dense copy of the same int weights, so they round like bfloat16 (int8: 0.5-0.7% on the embedded and the
# Qwen models): the same bound. It also covers an int8 probe read on a CPU whose dense calls run the other
# way (bfloat16 copy, or float32 dequantized per call): both are the int weights.
_POOLING_TOLERANCE = {"float32": (1e-3, None)}
_ROUNDED = (3e-2, 0.999)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_generation_pooling_equals_prefill_pooling(request, role):
    import torch

    lm = request.getfixturevalue(f"{role}_lm")
    state = lm.prefill(lm.format_prompt(QUESTION))
    s = lm.generate_step(state, n=1, temperature=0.0, max_tokens=24)[0]
    sc = lm.score_step(state, s.text)
    assert sc.token_ids == s.token_ids
    bound, min_cos = _POOLING_TOLERANCE.get(lm.format.name, _ROUNDED)
    for feat in ("last", "all"):
        a, b = s.pooled.feature(feat).float(), sc.pooled.feature(feat).float()
        if min_cos is None:
            rel = float((a - b).abs().max() / a.abs().mean())
            assert rel < bound, f"{role}/{feat}: relative pooling difference {rel:.2e}"
        else:
            rel = float((a - b).abs().mean() / a.abs().mean())
            cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
            assert rel < bound and cos > min_cos, (
                f"{role}/{feat} ({lm.dtype_name}): mean relative difference {rel:.2e}, cosine {cos:.5f}"
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


def test_the_converted_copy_is_the_gguf_model_bit_for_bit(embedded_pair, tmp_path, monkeypatch, caplog):
    """The draft converted from its GGUF file (a fresh cache), then read from the copy that load kept, then
    memory-mapped from the weight cache: the same weights, dtype, tokenizer, chat template, EOS ids and
    hidden states."""
    import logging
    import shutil

    import torch

    from semspec.models.lm import load_lm

    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    model_cfg = embedded_pair.draft
    with caplog.at_level(logging.INFO, logger="semspec.models.lm"):
        converted = load_lm(model_cfg)
        assert "kept the converted GGUF model" in caplog.text and "loaded the converted" not in caplog.text
        quantized = converted.format.quantized
        assert ("kept the quantized weights" in caplog.text) is quantized
        shutil.rmtree(tmp_path / "quantized", ignore_errors=True)  # so the next load reads the copy
        copy = load_lm(model_cfg)
        assert "loaded the converted copy" in caplog.text
        caplog.clear()
        mapped = load_lm(model_cfg)
    assert ("quantized weights memory-mapped" in caplog.text) is quantized
    assert "loaded the converted copy" not in caplog.text or not quantized, "no bfloat16 copy on the way"
    for other in (copy, mapped):
        a, b = converted.model.state_dict(), other.model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert copy.model.dtype == converted.model.dtype == torch.bfloat16
    for text in (QUESTION, "Step 1: 3 + 5 = 8.\n\nStep 2: 8 - 2 = 6. \\boxed{6} ünï ∑"):
        assert converted.tokenizer(text).input_ids == copy.tokenizer(text).input_ids
    assert converted.tokenizer.chat_template == copy.tokenizer.chat_template
    assert converted.eos_ids == copy.eos_ids
    assert converted.format_prompt(QUESTION) == copy.format_prompt(QUESTION)
    ids = torch.tensor([converted.tokenizer(QUESTION).input_ids])
    with torch.no_grad():
        ha = converted.model(ids, output_hidden_states=True).hidden_states[-1]
        hb = copy.model(ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(ha, hb)
