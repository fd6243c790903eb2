"""Scoring steps with ``LM``: prefill a step (or a row's run of steps) after its context and pool it as
generation does, read the model's probability and greedy choice at each of a step's tokens, and resume
greedy decoding after the leading tokens the model agrees with."""

from __future__ import annotations

import torch

from semspec.models.lm.cache import crop_to, fits_window
from semspec.models.lm.forward import Forwards
from semspec.models.lm.text import Text
from semspec.models.lm.types import LMState, Pooled, StepSample, StepScore, StepStart


class Scorer:
    """A model's scoring, greedy agreement and resume, built on its ``Forwards`` (the pooling is the model
    config's, read through ``text``)."""

    def __init__(self, text: Text, forwards: Forwards) -> None:
        self.text = text
        self.forwards = forwards

    def score_step(
        self, context: str | LMState, step_text: str, inplace: bool = False, logprobs: bool = True
    ) -> StepScore:
        """Prefill ``step_text`` after ``context`` and pool hidden states as generation does.

        A given ``LMState`` is reused: its cache is cloned, or with ``inplace`` extended in place (the
        decoder then keeps the returned state, or crops back via ``LMState.checkpoint``). A string is
        prefilled first. ``logprobs=False`` skips the per-token log-probs (and the output head for all but
        the last position), which is all a verifier needs.
        """
        if isinstance(context, str):
            base = self.forwards.prefill(context)
        else:
            base = context if inplace else context.clone()
        return self.score_steps([base], [step_text], logprobs)[0]

    def score_steps(self, states: list[LMState], texts: list[str], logprobs: bool = False) -> list[StepScore]:
        """``score_step`` in place for many rows (each its own context) in one padded prefill."""
        return [run[0] for run in self.score_runs(states, [[text] for text in texts], logprobs)]

    @torch.inference_mode()
    def score_runs(
        self, states: list[LMState], runs: list[list[str]], logprobs: bool = False
    ) -> list[list[StepScore]]:
        """Score each row's consecutive steps ``runs[b]`` after ``states[b]``, all of them in one padded
        prefill (mutates each ``states[b].cache``): one pass over the weights for a row's whole run, where
        scoring step by step makes one per step.

        Step ``j``'s score is what ``score_steps`` gives for it after the steps before it (the same
        positions, ids and pooling; the prefill's shape may round bfloat16 otherwise). Its ``state`` is the
        context up to and including the step; every state of a row shares the row's cache, which holds
        the whole run: a caller that keeps an earlier step's state crops the cache to that state's ids
        (``crop_to``; ``LMState.checkpoint`` and ``resume_after`` crop to what they restore).
        """
        if len(states) != len(runs) or any(not run for run in runs):
            raise ValueError("score_runs needs one non-empty run of steps per state")
        new_ids: list[list[int]] = []  # row -> the ids of its whole run
        ends: list[list[int]] = []  # row -> where each of its steps ends in ``new_ids[b]``
        for st, run in zip(states, runs, strict=True):
            text, ids, row_ends = st.text, list(st.ids), []
            for step in run:
                new = self.text.continuation_ids(text, ids, step)
                if not new:
                    raise ValueError("cannot score an empty step")
                text, ids = text + step, ids + new
                row_ends.append(len(ids) - len(st.ids))
            new_ids.append(ids[len(st.ids) :])
            ends.append(row_ends)
        outs = self.forwards.forward_rows([st.cache for st in states], new_ids, logprobs)
        # the outputs at each step's last token but the run's last predict the next step: one head call
        # for every such position of every row (the forward computed the run's last only)
        inner = [outs[b][1][e - 1, -1] for b, row_ends in enumerate(ends) for e in row_ends[:-1]]
        mid_logits = iter(
            self.forwards.head(torch.stack(inner)) if inner and not logprobs else []
        )  # (len(inner), V)
        scores = []
        for st, run, row_ends, ids, (logits, hidden, cache) in zip(
            states, runs, ends, new_ids, outs, strict=True
        ):
            text, prev_logits, prev_hidden, at, out = st.text, st.logits, st.hidden, 0, []
            for j, (step, end) in enumerate(zip(run, row_ends, strict=True)):
                new, seg = ids[at:end], hidden[at:end]  # seg (k, L+1, D): outputs at the step's own tokens
                # 1. positions predicting the step: the position before it + its tokens but the last
                pos_hidden = torch.cat([prev_hidden[None], seg[:-1]], dim=0)  # (k, L+1, D)
                lp = torch.empty(0)
                if logprobs:  # 2. per-token log-probs of the step's tokens
                    seg_logits = logits[at:end]  # (k, V)
                    pos_logits = torch.cat([prev_logits[None], seg_logits[:-1]], dim=0)  # (k, V)
                    lp = torch.log_softmax(pos_logits, dim=-1).gather(1, torch.tensor(new)[:, None])[:, 0]
                    end_logits = seg_logits[-1]
                else:
                    end_logits = logits[-1] if j == len(run) - 1 else next(mid_logits)
                text, prev_logits, prev_hidden = text + step, end_logits, seg[-1]
                pooled = Pooled((seg if self.text.config.pooling == "tokens" else pos_hidden).mean(dim=0))
                state = LMState(text, st.ids + ids[:end], cache, end_logits, seg[-1])
                out.append(StepScore(pooled, new, lp, state, pos_hidden))
                at = end
            scores.append(out)
        return scores

    @torch.inference_mode()
    def read_tokens(self, scores: list[StepScore]) -> None:
        """Fill each scored step's ``token_p`` (the probability the model gives each of its tokens) and
        ``greedy`` (the model's argmax at each position): the output head runs once over the positions
        that predicted the tokens of every step (rows together), where the scoring prefill ran it only at
        each step's end. A score already read is left alone."""
        todo = [sc for sc in scores if sc.token_p is None and sc.pred_hidden is not None and sc.token_ids]
        if not todo:
            return
        logits = self.forwards.head(torch.cat([sc.pred_hidden[:, -1] for sc in todo]))  # (sum k, V) float32
        ids = torch.tensor([t for sc in todo for t in sc.token_ids])  # (sum k,)
        token_p = (logits.gather(1, ids[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).exp()  # (sum k,)
        greedy = logits.argmax(-1)  # (sum k,)
        at = 0
        for sc in todo:
            k = len(sc.token_ids)
            sc.token_p, sc.greedy = token_p[at : at + k], greedy[at : at + k]
            at += k

    def greedy_agreement(self, score: StepScore) -> int:
        """How many leading tokens of a scored step are the model's own greedy choices (``read_tokens``:
        a head pass over the step's positions, only when asked)."""
        self.read_tokens([score])
        if score.greedy is None:
            return 0
        same = score.greedy == torch.tensor(score.token_ids)
        return int(same.long().cumprod(0).sum())

    @torch.inference_mode()
    def resume_after(
        self, context: LMState, score: StepScore, keep: int, max_tokens: int, seed: int | None = None
    ) -> StepStart | None:
        """Where to greedily write the step that starts with the first ``keep`` tokens of the scored step
        (the model's own greedy choices, see ``greedy_agreement``), reusing the cache the scoring filled:
        ``score.state`` is consumed. Decoding the returned start writes what decoding a step after ``context``
        would write greedily (``decode_steps``), token for token (the stop rules see the kept tokens too). None, with the
        cache untouched, when a sliding-window layer may have dropped positions (restore and decode)."""
        st, n, ids = score.state, len(context.ids), score.token_ids[:keep]
        if score.pred_hidden is None or not fits_window(st.cache, len(st.ids)):
            return None
        at = score.pred_hidden  # (k, L+1, D): the pooled positions of the scored step, as it pools
        if self.text.config.pooling == "tokens":
            at = torch.cat([score.pred_hidden[1:], st.hidden[None]])  # outputs at the step's own tokens
        # 1. the kept tokens may already end the step (a delimiter, EOS, the budget)
        for i in range(1, min(keep, max_tokens) + 1):
            done = self.text.check_stop(ids[:i])
            if done is not None or i == max_tokens:
                text, reason = done or (self.text.decode(ids[:i]), "length")
                crop_to(st.cache, n + i - 1)
                sample = StepSample(text, ids[:i], reason, Pooled(at[:i].mean(0)), 0.0)
                return StepStart(
                    context,
                    0,
                    seed,
                    LMState(context.text, context.ids, st.cache, context.logits, context.hidden),
                    done=sample,
                )
        # 2. continue after them: outputs at the position predicting token ``keep``
        crop_to(st.cache, n + keep)
        if keep < len(score.token_ids):
            hidden = score.pred_hidden[keep]  # (L+1, D)
            logits = self.forwards.head(hidden[-1][None])[0]  # (V,)
        else:
            logits, hidden = st.logits, st.hidden
        return StepStart(
            context,
            max_tokens - keep,
            seed,
            LMState(context.text, context.ids, st.cache, logits, hidden),
            ids,
        )
