"""Writing steps with ``LM`` (``StepWriter``): sample ``n`` continuations of each of several contexts, or one
or more steps per row, in one batched decode loop (``step_loop``), resuming a lookahead step an earlier
loop began and finishing each row's context after its last step."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from semspec.models.lm.cache import crop_to
from semspec.models.lm.forward import Forwards
from semspec.models.lm.step_loop import LoopRun, check_sampling, generator, sample_rows
from semspec.models.lm.text import Text
from semspec.models.lm.types import LMState, NextBudget, StepSample, StepStart


class StepWriter:
    """A model's decode calls: ``generate_step(s)``, ``decode_steps``, ``decode_runs`` and their helpers,
    built on its ``Forwards`` (``step_loop`` runs the loop; ``text`` says where a step ends)."""

    def __init__(self, text: Text, forwards: Forwards) -> None:
        self.text = text
        self.forwards = forwards

    def generate_step(
        self,
        context: str | LMState,
        n: int = 1,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[StepSample]:
        """Sample ``n`` continuations of ``context``, each up to and including the step delimiter, EOS
        or ``max_tokens``, in one batched decode loop (finished rows leave the batch).

        ``temperature == 0`` is greedy. The context's cache is shared (copied, not re-prefilled).
        """
        return self.generate_steps([context], n, temperature, top_p, max_tokens, [seed])[0]

    @torch.inference_mode()
    def generate_steps(
        self,
        contexts: list[str | LMState],
        n: int = 1,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tokens: int | None = None,
        seeds: list[int | None] | None = None,
    ) -> list[list[StepSample]]:
        """``generate_step`` for several contexts at once: the ``n`` continuations of every context share
        one batched decode loop (one pass over the weights per token for all of them, which is what makes
        sampling many prefixes fast); context i's rows draw from one generator seeded with ``seeds[i]``.
        Returns, per context, its ``n`` samples."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        seeds = [None] * len(contexts) if seeds is None else seeds
        if len(seeds) != len(contexts):
            raise ValueError(f"one seed per context: {len(seeds)} seeds for {len(contexts)} contexts")
        check_sampling(temperature, top_p)
        max_tokens = self.text.config.max_step_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        starts, gens = [], []
        for context, seed in zip(contexts, seeds, strict=True):
            state = self.forwards.prefill(context) if isinstance(context, str) else context
            gen = generator(seed)
            for _ in range(n):
                copied = LMState(
                    state.text, state.ids, copy.deepcopy(state.cache), state.logits, state.hidden
                )
                starts.append(StepStart(state, max_tokens, state=copied))
                gens.append(gen)
        runs = sample_rows(self.text, self.forwards, starts, temperature, top_p, gens)
        samples = [run.samples[0] for run in runs]
        self._close_pooling(samples, [run.cache for run in runs])
        return [samples[i * n : (i + 1) * n] for i in range(len(contexts))]

    def _close_pooling(self, samples: list[StepSample], caches: list[Cache]) -> None:
        """``tokens`` pooling of steps whose last token no loop fed: feed it after each row's cache (which
        holds everything but that token; extended here) in one padded forward, and pool its output."""
        owed = [b for b, s in enumerate(samples) if s.owed is not None]
        if not owed:
            return
        fed = self.forwards.forward_rows(
            [caches[b] for b in owed], [[samples[b].token_ids[-1]] for b in owed]
        )
        for b, (_, hidden, _) in zip(owed, fed, strict=True):
            samples[b].close_pooling(hidden[-1])  # (L+1, D) at the step's last token

    @torch.inference_mode()
    def decode_steps(
        self, starts: list[StepStart], temperature: float = 0.0, top_p: float = 1.0
    ) -> list[tuple[StepSample, LMState]]:
        """Write one step per row, all rows in one batched decode loop (each stops at its own delimiter,
        EOS or budget and leaves the batch), reusing each row's cache in place. Returns, per row, the step
        and its context extended by the step's text."""
        return [(steps[0], state) for steps, state in self.decode_runs(starts, temperature, top_p)]

    @torch.inference_mode()
    def decode_runs(
        self,
        starts: list[StepStart],
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_steps: int = 1,
        more: NextBudget | None = None,
    ) -> list[tuple[list[StepSample], LMState]]:
        """Write consecutive steps per row, all rows in one batched decode loop, reusing each row's cache
        in place. Each row writes ``min_steps`` steps (fewer after EOS, an empty step or when ``more`` says
        stop); while some row still owes one, the rows that are done may write *lookahead* steps instead of
        idling, as long as ``more(row, steps so far)`` gives the next step's token budget (None: stop). A
        lookahead step still unfinished when the loop ends leaves the cache, and the returned state keeps
        it (``LMState.partial``): a later call that starts the same step (same seed) from that state goes on
        with it, when its tokens fit that call's budget. Step ``j`` of a row samples with ``seed + j``, so a
        row writes the same steps whatever the rest of the batch does. Returns, per row, its steps and its
        context extended by all of them."""
        check_sampling(temperature, top_p)
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        if any(st.done is None and st.max_tokens < 1 for st in starts):
            raise ValueError("max_tokens must be >= 1")
        starts = self._resume_partials(starts)
        return self._run_states(starts, self._loop(starts, temperature, top_p, min_steps, more))

    def _loop(
        self,
        starts: list[StepStart],
        temperature: float,
        top_p: float,
        min_steps: int,
        more: NextBudget | None,
    ) -> list[LoopRun]:
        """The decode loop over the rows that still write a step (a row whose start is already a finished
        step, ``StepStart.done``, has that step as its run); each row draws from its partial step's
        generator or a fresh one seeded with its seed."""
        runs = [LoopRun([st.done], st.source.cache) if st.done is not None else None for st in starts]
        live = [i for i, st in enumerate(starts) if st.done is None]
        sub = None if more is None else (lambda b, done: more(live[b], done))
        gens = [starts[i].partial.gen if starts[i].partial else generator(starts[i].seed) for i in live]
        sampled = sample_rows(
            self.text, self.forwards, [starts[i] for i in live], temperature, top_p, gens, min_steps, sub
        )
        for i, run in zip(live, sampled, strict=True):
            runs[i] = run
        return runs

    def _run_states(
        self, starts: list[StepStart], runs: list[LoopRun]
    ) -> list[tuple[list[StepSample], LMState]]:
        """Each row's steps and its context extended by all of them: from the outputs the loop kept after
        the row's last complete step, else by finishing the last step (``_finish_steps``, batched)."""
        out: list[tuple[list[StepSample], LMState] | None] = [None] * len(starts)
        tails = []  # rows whose last step ends in the loop's final tokens: finished below, batched
        for i, (st, run) in enumerate(zip(starts, runs, strict=True)):
            ctx = st.context
            if run.boundary is None:
                tails.append((i, ctx))
                continue
            # the row fed its last complete step inside the loop: outputs after it were kept there
            length, logits, hidden = run.boundary
            done = run.samples if run.dropped else run.samples[:-1]
            state = LMState(
                ctx.text + "".join(x.text for x in done),
                ctx.ids + [t for x in done for t in x.token_ids],
                run.cache,
                logits,
                hidden,
            )
            if run.dropped:
                crop_to(run.cache, length)
                state.partial = run.partial
                out[i] = (run.samples, state)
            else:
                tails.append((i, state))
        finished = self._finish_steps(
            [ctx for _, ctx in tails],
            [runs[i].samples[-1] for i, _ in tails],
            [runs[i].cache for i, _ in tails],
        )
        for (i, _), (_, state) in zip(tails, finished, strict=True):
            runs[i].samples[-1].close_pooling(state.hidden)  # ``tokens`` pooling: the last token's output
            out[i] = (runs[i].samples, state)
        return out

    def _resume_partials(self, starts: list[StepStart]) -> list[StepStart]:
        """``starts`` where each row whose context holds the partial step it is about to write (same seed,
        tokens within its budget) goes on with it: the partial tokens are fed after each such context, all
        in one padded prefill, and the row's loop starts after them."""
        take = [
            i
            for i, st in enumerate(starts)
            if st.done is None
            and st.state is None
            and not st.prefix
            and (p := st.context.partial) is not None
            and p.seed == st.seed
            and len(p.tokens) < st.max_tokens
        ]
        if not take:
            return starts
        out = list(starts)
        fed = self.forwards.forward_rows(
            [starts[i].context.cache for i in take], [starts[i].context.partial.tokens for i in take]
        )
        for i, (logits, hidden, cache) in zip(take, fed, strict=True):
            st = starts[i]
            ctx = st.context
            state = LMState(ctx.text, ctx.ids, cache, logits[-1], hidden[-1])
            out[i] = StepStart(ctx, st.max_tokens, st.seed, state, partial=ctx.partial)
        return out

    def _finish_steps(
        self, contexts: list[LMState], samples: list[StepSample], caches: list[Cache]
    ) -> list[tuple[StepSample, LMState]]:
        """Each context extended by its step, given caches that hold ``context.ids + step.token_ids[:-1]``:
        the last token is fed when the step is exactly its tokens; otherwise (EOS, a delimiter cut inside a
        token, special tokens) the cache rolls back and the text is prefilled. Batched over rows."""
        out: list[LMState | None] = [None] * len(samples)
        feed, refill = [], []
        for i, (ctx, s, cache) in enumerate(zip(contexts, samples, caches, strict=True)):
            exact = s.finish_reason != "eos" and self.text.decode(s.token_ids) == s.text
            if exact:
                feed.append(i)
                continue
            crop_to(cache, len(ctx.ids))
            out[i] = LMState(ctx.text, ctx.ids, cache, ctx.logits, ctx.hidden)
            if s.text:
                refill.append(i)
        fed = (
            self.forwards.forward_rows([caches[i] for i in feed], [[samples[i].token_ids[-1]] for i in feed])
            if feed
            else []
        )
        for i, (logits, hidden, cache) in zip(feed, fed, strict=True):
            ctx, s = contexts[i], samples[i]
            out[i] = LMState(ctx.text + s.text, ctx.ids + s.token_ids, cache, logits[-1], hidden[-1])
        if refill:
            extended = self.forwards.extend_many([out[i] for i in refill], [samples[i].text for i in refill])
            for i, ext in zip(refill, extended, strict=True):
                out[i] = ext[0]
        return list(zip(samples, out, strict=True))
