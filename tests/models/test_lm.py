"""LM adapter on tiny models built from a config: stopping, batching, pooling, bad input."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny import tiny_lm

DELIM = "\n\n"


def _check_sample(lm, s, max_tokens):
    """Invariants every sample must satisfy, whatever its finish reason."""
    assert s.finish_reason in ("delimiter", "eos", "length")
    if s.finish_reason == "delimiter":
        assert s.text.endswith(DELIM)
        assert DELIM not in s.text[: -len(DELIM)], "stopped late: an earlier delimiter was skipped"
        # the delimiter arrived with the last token, not before it
        assert DELIM not in lm.tokenizer.decode(s.token_ids[:-1])
    elif s.finish_reason == "length":
        assert s.num_tokens == max_tokens
        assert DELIM not in s.text
    else:
        assert s.token_ids[-1] in lm.eos_ids
    assert s.pooled.h_layers.shape == (lm.num_layers + 1, lm.hidden_size)
    assert torch.isfinite(s.pooled.h_layers).all()


def test_batched_sampling_stops_each_row_at_the_delimiter():
    lm = tiny_lm(boost=3.0)  # the newline token is likely, so rows stop at different lengths
    samples = lm.generate_step(
        "Question: 1+1?\nAnswer:", n=16, temperature=1.0, top_p=1.0, max_tokens=30, seed=1
    )
    assert len(samples) == 16
    for s in samples:
        _check_sample(lm, s, 30)
    reasons = {s.finish_reason for s in samples}
    assert "delimiter" in reasons
    assert len({s.num_tokens for s in samples}) > 1, (
        "all rows the same length: per-row stopping not exercised"
    )


def test_delimiter_inside_a_token_is_cut_after_the_delimiter():
    # '.\n\nT' carries the delimiter followed by text: the step must end right after '\n\n'
    lm = tiny_lm(merged=True, boost=4.0)
    samples = lm.generate_step("Q: go\nA:", n=24, temperature=1.0, top_p=1.0, max_tokens=20, seed=3)
    for s in samples:
        _check_sample(lm, s, 20)
    merged_ids = set(lm.tokenizer.convert_tokens_to_ids([".\n\nT"]))
    cut = [s for s in samples if s.finish_reason == "delimiter" and s.token_ids[-1] in merged_ids]
    assert cut, "no sample ended on the merged token; raise the boost"
    for s in cut:
        assert s.text.endswith(".\n\n") and not s.text.endswith("T")


def test_greedy_batch_equals_single_sequence():
    lm = tiny_lm(boost=1.5)
    ctx = "Question: 2+2?\nAnswer:"
    one = lm.generate_step(ctx, n=1, temperature=0.0, max_tokens=20)[0]
    many = lm.generate_step(ctx, n=4, temperature=0.0, max_tokens=20)
    for s in many:
        assert s.token_ids == one.token_ids
        assert torch.allclose(s.pooled.h_layers, one.pooled.h_layers, atol=1e-5)


def test_seed_makes_sampling_reproducible():
    lm = tiny_lm(boost=1.0)
    a = lm.generate_step("Q: x\nA:", n=6, temperature=0.8, top_p=0.9, max_tokens=12, seed=7)
    b = lm.generate_step("Q: x\nA:", n=6, temperature=0.8, top_p=0.9, max_tokens=12, seed=7)
    c = lm.generate_step("Q: x\nA:", n=6, temperature=0.8, top_p=0.9, max_tokens=12, seed=8)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


@pytest.mark.parametrize("pooling", ["predict", "tokens"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_pooling_at_generation_equals_pooling_at_prefill(temperature, pooling):
    lm = tiny_lm(boost=2.0, pooling=pooling)  # character tokenizer: re-tokenising gives the same ids
    ctx = "Question: what is 3*4?\nAnswer:"
    state = lm.prefill(ctx)
    samples = lm.generate_step(state, n=4, temperature=temperature, top_p=1.0, max_tokens=16, seed=0)
    special = set(lm.tokenizer.all_special_ids)
    plain = [s for s in samples if not special & set(s.token_ids)]  # random models emit <s>/<pad> too
    assert plain
    for s in plain:
        sc = lm.score_step(state, s.text)
        assert sc.token_ids == s.token_ids
        for feat in ("last", "all", "mix"):
            a, b = s.pooled.feature(feat), sc.pooled.feature(feat)
            assert (a - b).abs().max() < 1e-3 * a.abs().mean()
    # the state passed in is not modified by sampling or scoring
    assert state.cache.get_seq_length() == len(state.ids)


@pytest.mark.parametrize("reason", ["delimiter", "length", "eos"])
def test_each_pooling_averages_the_positions_it_names(reason):
    """Against one plain forward over context + step: ``predict`` pools the outputs at the last context
    position and all step tokens but the last; ``tokens`` the outputs at the step's own tokens (an EOS
    that ends the step is none of them). Both in generation and in prefill."""
    ctx = "Question: what is 3*4?\nAnswer:"
    eos = reason == "eos"
    pooled = {}
    for pooling in ("predict", "tokens"):
        lm = tiny_lm(pooling=pooling, boost=3.0, eos_bias=1.0)
        samples = lm.generate_step(ctx, n=16, temperature=1.0, top_p=1.0, max_tokens=12, seed=1)
        special = set(lm.tokenizer.all_special_ids) - lm.eos_ids  # random models emit <s>/<pad> too
        s = next(
            x
            for x in samples
            if x.finish_reason == reason and x.num_tokens >= 3 and not special & set(x.token_ids)
        )
        assert s.owed is None
        m = len(lm.encode(ctx))
        ids = torch.tensor([lm.encode(ctx) + s.token_ids])
        with torch.no_grad():
            out = lm.model(ids, output_hidden_states=True)
        h = torch.stack(out.hidden_states, dim=2)[0].float()  # (m + k, L+1, D)
        k = len(s.token_ids) - eos  # the step's tokens, EOS excluded
        want = h[m - 1 : m + k - 1] if pooling == "predict" else h[m : m + k]
        if pooling == "predict" and eos:
            want = h[m - 1 : m + k]  # predict pools the position that predicted the EOS too
        assert torch.allclose(s.pooled.h_layers, want.mean(0), atol=1e-4)
        if not eos:
            sc = lm.score_step(ctx, s.text)
            assert torch.allclose(sc.pooled.h_layers, want.mean(0), atol=1e-4)
        pooled[pooling] = s.pooled.h_layers
    assert not torch.allclose(pooled["predict"], pooled["tokens"], atol=1e-3)


def test_score_step_logprobs_match_greedy_generation():
    lm = tiny_lm(boost=2.0)
    ctx = "Q: 5-1\nA:"
    s = lm.generate_step(ctx, n=1, temperature=0.0, max_tokens=10)[0]
    sc = lm.score_step(ctx, s.text)
    assert sc.logprobs.shape == (len(sc.token_ids),)
    assert sc.logprobs.sum().item() == pytest.approx(s.logprob, abs=1e-4)
    assert sc.state.ids[-len(sc.token_ids) :] == sc.token_ids
    assert sc.state.cache.get_seq_length() == len(sc.state.ids)


def test_extend_keeps_cache_in_step_with_ids():
    lm = tiny_lm()
    st = lm.prefill("Question: a\nAnswer:")
    st2, new_ids, logits, hidden = lm.extend(st.clone(), " first.\n\n")
    assert st2.ids == st.ids + new_ids
    assert logits.shape[0] == 1 and hidden.shape[0] == len(new_ids)
    _, _, all_logits, _ = lm.extend(lm.prefill("Question: a\nAnswer:"), " first.\n\n", all_logits=True)
    assert all_logits.shape[0] == len(new_ids)
    assert torch.allclose(all_logits[-1], logits[-1], atol=1e-4)
    full = lm.prefill("Question: a\nAnswer: first.\n\n")
    assert full.ids == st2.ids
    assert torch.allclose(full.hidden, st2.hidden, atol=1e-4)


@pytest.mark.parametrize("pooling", ["predict", "tokens"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_score_runs_equals_scoring_step_after_step(pooling, logprobs):
    """One prefill of a row's consecutive steps gives each step what scoring it alone after the steps
    before gives (ids, pooled features, log-probs, the state after it), rows of different lengths
    padded together; every state of a row shares its cache, which a crop takes back to any of them."""
    lm = tiny_lm(merged=True, pooling=pooling)
    contexts = ["Question: a\nAnswer:", "Question: a longer one here\nAnswer:"]
    runs = [[" first.\n\n", " then 2 + 3 = 5.\n\n", " so 5"], [" one step\n\n"]]
    together = lm.score_runs([lm.prefill(c) for c in contexts], runs, logprobs)
    for ctx, run, scores in zip(contexts, runs, together, strict=True):
        state = lm.prefill(ctx)
        assert len(scores) == len(run)
        for step, sc in zip(run, scores, strict=True):
            ref = lm.score_step(state, step, logprobs=logprobs)
            assert sc.token_ids == ref.token_ids and sc.state.ids == ref.state.ids
            assert sc.state.text == ref.state.text
            torch.testing.assert_close(sc.pooled.h_layers, ref.pooled.h_layers, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(sc.pred_hidden, ref.pred_hidden, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(sc.state.logits, ref.state.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(sc.state.hidden, ref.state.hidden, atol=1e-4, rtol=1e-4)
            if logprobs:
                torch.testing.assert_close(sc.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
            state = ref.state
        assert scores[-1].state.cache.get_seq_length() == len(scores[-1].state.ids)
        assert all(sc.state.cache is scores[0].state.cache for sc in scores)
    first = together[0][0].state
    restore = first.checkpoint(0)  # back to the first step of a three-step run
    assert restore().cache.get_seq_length() == len(first.ids)
    nxt = lm.extend(first, " again.\n\n")[0]
    torch.testing.assert_close(
        nxt.hidden, lm.prefill(first.text + " again.\n\n").hidden, atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="non-empty run"):
        lm.score_runs([lm.prefill(contexts[0])], [[]])


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_generate_step_rejects_bad_arguments(kwargs, msg):
    lm = tiny_lm()
    with pytest.raises(ValueError, match=msg):
        lm.generate_step("Q: a\nA:", **kwargs)


def test_prompts_plain_template_and_missing_chat_template():
    lm = tiny_lm()
    assert (
        lm.format_prompt("  What is 1+1? ") == "Question: What is 1+1?\nAnswer: Let's think step by step.\n\n"
    )
    with pytest.raises(ValueError, match="non-empty"):
        lm.format_prompt("   ")
    chat = tiny_lm(prompt="chat")
    with pytest.raises(ValueError, match="no chat template"):
        chat.format_prompt("hi")


def test_encode_adds_bos_once():
    lm = tiny_lm()
    ids = lm.encode("ab")
    assert ids[0] == lm.tokenizer.bos_token_id and ids.count(lm.tokenizer.bos_token_id) == 1
    assert lm.encode("<s>ab") == ids


def test_a_prompt_longer_than_the_context_is_refused_not_cut():
    lm = tiny_lm()  # max_position_embeddings 2048
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens and the model's context holds 2048"):
        lm.prefill("x" * 2100)
    assert lm.prefill("x" * 100).ids  # a prompt that fits is cached


def test_a_delimiter_the_tokenizer_cannot_write_is_refused():
    with pytest.raises(ValueError, match=r"cannot write the step delimiter '¶¶'"):
        tiny_lm(delimiter="¶¶")  # not in the character vocabulary: it decodes to nothing
