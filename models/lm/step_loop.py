"""The batched decode loop: rows sample until each reaches its own stop (a delimiter, EOS or its budget),
finished rows leave the batch or go on with their next step (lookahead), and every row gets back its own
cache.

Two objects carry the loop's state. ``_LiveRow`` is one row while it samples: its tokens, where its step
began, its budget, the pooled sums and log-probability of the step under way, its generator and its
output so far (``LoopRun``). ``_Batch`` is the padded batch: the shared cache (rows stacked left-padded),
the outputs at each live row's last position and how many tokens were fed; it selects the rows that go
on, feeds them, and cuts a leaving row's own cache out of the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from semspec.models.lm.cache import row_cache, stack_caches, stackable
from semspec.models.lm.forward import Forwards
from semspec.models.lm.sampling import sample_tokens
from semspec.models.lm.text import Text
from semspec.models.lm.types import NextBudget, Partial, Pooled, StepSample, StepStart, pool_tokens


@dataclass
class LoopRun:
    """One row's output of a decode loop: its steps and its own cache."""

    samples: list[StepSample]
    cache: Cache | None = None
    # (positions, logits (V,), hidden (L+1, D)) right after the last step the loop fed; None when none
    boundary: tuple[int, torch.Tensor, torch.Tensor] | None = None
    dropped: bool = False  # the loop ended inside a lookahead step: its tokens leave the cache
    partial: Partial | None = None  # that step, for a later loop to go on with


def for_row(more: NextBudget | None, i: int) -> NextBudget | None:
    """``more`` for a loop of row ``i`` alone."""
    return None if more is None else (lambda _b, done: more(i, done))


class _LiveRow:
    """Row ``index`` of the loop while it samples the step under way (see the module notes)."""

    def __init__(
        self,
        index: int,
        start: StepStart,
        gen: torch.Generator,
        forwards: Forwards,
        pooling: str,
        length: int,
        pad: int,
    ):
        shape = (forwards.num_layers + 1, forwards.hidden_size)
        self.index, self.start, self.gen, self.length, self.pad = index, start, gen, length, pad
        self.tokens, self.plen, self.budget = list(start.prefix), len(start.prefix), start.max_tokens
        self.hsum = torch.zeros(shape)  # (L+1, D): outputs at the positions predicting the step's tokens
        # ``tokens`` pooling: (L+1, D) the output predicting the step's first token, which it leaves out
        self.hfirst = torch.zeros(shape) if pooling == "tokens" else None
        self.lp_sum = torch.zeros(())  # float32: the step's summed log-probabilities
        self.run = LoopRun([])
        if start.partial is not None:  # go on with a step an earlier loop began: its tokens count
            p = start.partial
            self.tokens, self.plen, self.hsum = list(p.tokens), 0, p.hsum.clone()
            self.lp_sum = torch.tensor(p.lp_sum)
            if self.hfirst is not None and p.hfirst is not None:
                self.hfirst = p.hfirst.clone()

    def pool(self, hidden: torch.Tensor) -> None:
        """Pool ``hidden`` (L+1, D), the output predicting the token about to be sampled."""
        self.hsum += hidden
        if self.hfirst is not None and len(self.tokens) == self.plen:
            self.hfirst = hidden.clone()

    def take(self, token: int, lp: torch.Tensor, text: Text) -> StepSample | None:
        """Append a sampled token (log-probability ``lp``); the step when it ends here, else None."""
        self.tokens.append(token)
        self.lp_sum += lp
        done = text.check_stop(self.tokens)
        count = len(self.tokens) - self.plen
        if done is None and count < self.budget:
            return None
        written, reason = done or (text.decode(self.tokens), "length")
        sample = StepSample(
            written, self.tokens, reason, Pooled(self.hsum / max(1, count)), float(self.lp_sum)
        )
        if self.hfirst is not None:
            pool_tokens(sample, self.hsum - self.hfirst, count)
        self.run.samples.append(sample)
        return sample

    def owes(self, min_steps: int) -> bool:
        """Whether the row has written fewer than ``min_steps`` steps."""
        return len(self.run.samples) < min_steps

    def next_step(self, budget: int) -> None:
        """Start the row's next step in this loop: fresh tokens, pooling and generator."""
        self.tokens, self.plen, self.budget = [], 0, budget
        self.hsum, self.lp_sum = torch.zeros_like(self.hsum), torch.zeros(())
        self.gen = generator(self._next_seed())

    def set_aside(self) -> None:
        """The loop ends inside this row's (lookahead) step: its tokens leave the cache and the step is
        kept (``LoopRun.partial``) for the next loop of this row to go on with."""
        hfirst = None if self.hfirst is None else self.hfirst.clone()
        self.run.dropped = True
        self.run.partial = Partial(
            list(self.tokens), self.hsum.clone(), hfirst, float(self.lp_sum), self.gen, self._next_seed()
        )

    def _next_seed(self) -> int | None:
        """Step ``j`` of a row samples with ``seed + j``."""
        seed = self.start.seed
        return None if seed is None else seed + len(self.run.samples)


class _Batch:
    """The loop's padded batch (see the module notes)."""

    def __init__(self, text: Text, forwards: Forwards, starts: list[StepStart], gens: list[torch.Generator]):
        caches = [st.source.cache for st in starts]
        lens = [c.get_seq_length() for c in caches]
        self.forwards, self.width, self.fed, self.stacked = forwards, max(lens), 0, len(starts) > 1
        self.hf_config = forwards.model.config
        self.cache = stack_caches(self.hf_config, caches, lens, self.width) if self.stacked else caches[0]
        self.logits = torch.stack([st.source.logits for st in starts])  # (B, V)
        self.hidden = torch.stack([st.source.hidden for st in starts])  # (B, L+1, D)
        self.all = [
            _LiveRow(i, st, g, forwards, text.config.pooling, n, self.width - n)
            for i, (st, g, n) in enumerate(zip(starts, gens, lens, strict=True))
        ]
        self.rows = list(self.all)  # the live rows, in batch order

    def pool(self) -> None:
        """Every live row pools the output predicting the token it samples next."""
        for b, row in enumerate(self.rows):
            row.pool(self.hidden[b])

    def retire(self, b: int) -> None:
        """Batch row ``b`` leaves: its own cache holds its context, prefix and sampled tokens but the last."""
        row = self.rows[b]
        end = self.width + self.fed
        row.run.cache = row_cache(self.hf_config, self.cache, b, row.pad, end) if self.stacked else self.cache

    def select(self, keep: list[int], nxt: torch.Tensor) -> torch.Tensor:
        """Keep batch rows ``keep`` (sorted) in the cache and the batch; returns their tokens of ``nxt``."""
        if len(keep) == len(self.rows):
            return nxt
        self.cache.batch_select_indices(torch.tensor(keep))
        self.rows = [self.rows[b] for b in keep]
        return nxt[keep]

    def feed(self, nxt: torch.Tensor) -> None:
        """Feed each live row its token, ``nxt`` (B,): the outputs at it are what the rows sample from next."""
        mask = pos = None
        if any(row.pad for row in self.rows):
            pads = torch.tensor([row.pad for row in self.rows])[:, None]  # (B, 1)
            mask = (torch.arange(self.width + self.fed + 1)[None] >= pads).long()  # (B, width + fed + 1)
            pos = torch.tensor([row.length + self.fed for row in self.rows])[:, None]  # (B, 1)
        logits, hidden, self.cache = self.forwards.forward(nxt[:, None], self.cache, False, mask, pos)
        self.logits, self.hidden = logits[:, -1], hidden[:, -1]  # (B, V), (B, L+1, D)
        self.fed += 1

    def mark_boundaries(self, turned: list[_LiveRow]) -> None:
        """The outputs right after each ``turned`` row's finished step (just fed): where a dropped lookahead
        step rolls back to, and (``tokens`` pooling) the output at that step's last token."""
        for b, row in enumerate(self.rows):
            if any(row is t for t in turned):
                row.run.boundary = (row.length + self.fed, self.logits[b].clone(), self.hidden[b].clone())
                row.run.samples[-1].close_pooling(self.hidden[b])


def sample_rows(
    text: Text,
    forwards: Forwards,
    starts: list[StepStart],
    temperature: float,
    top_p: float,
    gens: list[torch.Generator],
    min_steps: int = 1,
    more: NextBudget | None = None,
) -> list[LoopRun]:
    """The batched decode loop of a model (``forwards`` runs it, ``text`` says where a step ends): every row
    samples until its own stop, the finished ones leave the batch (or, see ``StepWriter.decode_runs``, go on with their next step). Row caches are stacked left-padded for
    the loop (or, when they cannot be, rows run one after another); each row gets back its own cache
    holding its context, prefix and sampled tokens but the last. Pooled states cover the positions
    predicting each step's newly sampled tokens, or with ``tokens`` pooling those tokens' own (a step
    that ends the loop owes its last one: ``StepSample.owed``)."""
    if not starts:
        return []
    if len(starts) > 1 and not _can_stack(forwards, starts, min_steps):
        return [
            sample_rows(text, forwards, [st], temperature, top_p, [g], min_steps, for_row(more, i))[0]
            for i, (st, g) in enumerate(zip(starts, gens, strict=True))
        ]
    batch = _Batch(text, forwards, starts, gens)
    while True:
        batch.pool()
        nxt, lp = sample_tokens(batch.logits, [r.gen for r in batch.rows], temperature, top_p)  # (B,), (B,)
        going, turning, leaving = _classify(text, batch.rows, nxt, lp, more)
        if not any(batch.rows[b].owes(min_steps) for b in going + list(turning)):
            for b in going:  # nobody owes a step: the loop ends, lookahead steps under way are set aside
                batch.rows[b].set_aside()
            leaving += going + list(turning)
            going, turning = [], {}
        for b in leaving:
            batch.retire(b)
        keep = sorted(going + list(turning))
        if not keep:
            return [row.run for row in batch.all]
        turned = [batch.rows[b] for b in turning]
        for b, budget in turning.items():
            batch.rows[b].next_step(budget)
        batch.feed(batch.select(keep, nxt))
        batch.mark_boundaries(turned)


def _can_stack(forwards: Forwards, starts: list[StepStart], min_steps: int) -> bool:
    """Whether the rows' caches can share one padded batch for the whole loop: it runs at most
    ``min_steps`` budgets (budgets never grow)."""
    caches = [st.source.cache for st in starts]
    width = max(c.get_seq_length() for c in caches)
    return stackable(caches, forwards.cache_layout, width + min_steps * max(st.max_tokens for st in starts))


def _classify(
    text: Text, rows: list[_LiveRow], nxt: torch.Tensor, lp: torch.Tensor, more: NextBudget | None
) -> tuple[list[int], dict[int, int], list[int]]:
    """Each live row takes its sampled token: batch rows still in their step, rows on to a next step in
    this loop (-> that step's budget, from ``more``), and rows leaving. A next step continues the cache as
    is only when the finished step is exactly its tokens."""
    going, turning, leaving = [], {}, []
    for b, row in enumerate(rows):
        sample = row.take(int(nxt[b]), lp[b], text)
        if sample is None:
            going.append(b)
            continue
        budget = more(row.index, row.run.samples) if more is not None and _exact(text, sample) else None
        if budget is None or budget < 1:
            leaving.append(b)
        else:
            turning[b] = budget
    return going, turning, leaving


def _exact(text: Text, sample: StepSample) -> bool:
    """Whether a step's text is exactly what its tokens decode to (no EOS, no delimiter cut inside a token)."""
    if sample.finish_reason == "eos" or not sample.text:
        return False
    if sample.finish_reason == "length":  # its text is its tokens decoded
        return True
    return text.decode(sample.token_ids) == sample.text


def check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a fresh random seed when None)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    return gen
