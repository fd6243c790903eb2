"""The forward passes of ``LM`` (``Forwards``): one forward (the decode kernel's path for unpadded rows), the
output head, many rows with their own caches in one padded forward, and prefill / extend of contexts built
on them."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from semspec.models.cpu import decode_layer
from semspec.models.cpu.formats import Format
from semspec.models.lm.cache import row_cache, stack_caches, stackable
from semspec.models.lm.text import Text
from semspec.models.lm.types import LMState


class Forwards:
    """A model's forwards, prefill and extend; a row's cache is always its own. ``text`` tokenizes the
    contexts prefill and extend are given; ``fmt`` is what the model runs in (its kernels are the loader's,
    ``install_kernels``)."""

    def __init__(self, model: PreTrainedModel, text: Text, fmt: Format) -> None:
        self.model = model.eval()
        self.text = text
        self.format = fmt
        self.model_id = text.model_id
        self.device = next(model.parameters()).device
        text_cfg = model.config.get_text_config()
        self.num_layers: int = int(text_cfg.num_hidden_layers)
        self.hidden_size: int = int(text_cfg.hidden_size)
        # an empty cache of this model's layer types, built once: its sliding windows bound padded batches
        self.cache_layout = DynamicCache(config=model.config)
        window = getattr(text_cfg, "max_position_embeddings", None)
        self.context_window: int | None = int(window) if window else None  # positions the model was built for

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: Cache | None,
        all_logits: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Cache]:
        """One forward pass. ``ids`` (B, T) -> logits (B, T or 1, V) float32, hidden (B, T, L+1, D) float32, cache.

        Logits are computed for the last position only unless ``all_logits``: with a large vocabulary
        (Gemma: 262k) the output head costs as much as the rest of the model per position. A padded
        batch passes its ``attention_mask`` (B, cached + T) and ``position_ids`` (B, T). ``keep`` (B,)
        names one position per row whose hidden states are returned, (B, 1, L+1, D): a prompt's prefill
        needs its last position only, and every layer at every position of a long prompt in float32 is
        gigabytes (a 7,915-token prompt of the 1.5B model: 1.4 GB).
        """
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        if (
            attention_mask is None
            and (whole := decode_layer.decode_model(self.model, ids, cache)) is not None
        ):
            logits, hidden = whole  # a decoding call of unpadded rows, the model's layers all in the kernel
            if keep is not None:
                hidden = hidden[torch.arange(hidden.shape[0]), keep][:, None]  # (B, 1, L+1, D)
            return logits.float(), hidden.to(torch.float32, memory_format=torch.contiguous_format), cache
        extra = {}
        if attention_mask is not None:
            extra = {
                "attention_mask": attention_mask.to(self.device),
                "position_ids": position_ids.to(self.device),
            }
        out = self.model(
            ids.to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=0 if all_logits else 1,
            **extra,
        )
        if keep is None:
            hidden = torch.stack(out.hidden_states, dim=2).float()  # (B, T, L+1, D)
        else:
            rows = torch.arange(ids.shape[0])
            hidden = torch.stack([h[rows, keep] for h in out.hidden_states], dim=1)[
                :, None
            ].float()  # (B, 1, L+1, D)
        return out.logits.float(), hidden, out.cache

    def head(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits from final-layer hidden states (after the final norm): (N, D) -> (N, V) float32."""
        head = self.model.get_output_embeddings()
        logits = head(last_hidden.to(self.format.activations).to(self.device)).float().cpu()
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def forward_rows(
        self,
        caches: list[Cache | None],
        new_ids: list[list[int]],
        all_logits: bool = False,
        last_only: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor, Cache]]:
        """Feed ``new_ids[b]`` after ``caches[b]`` for every row, in one padded forward.

        Each row keeps its own cache: they are stacked left-padded for the forward (the new ids
        right-padded) and split again after it, so no row ever sees another's positions. Returns, per row,
        logits (k_b, V) with ``all_logits`` else (1, V) at its last new position, hidden (k_b, L+1, D) and
        its cache (the old one extended in place when the row ran alone). With ``last_only`` each row's hidden
        states are those of its last new position only, (1, L+1, D) (a prompt's prefill).
        """
        if any(not ids for ids in new_ids):
            raise ValueError("every row needs at least one new token")
        lens = [0 if c is None else c.get_seq_length() for c in caches]
        width, k = max(lens), max(len(ids) for ids in new_ids)
        if len(caches) == 1 or not stackable(caches, self.cache_layout, width + k):
            rows = []
            for cache, ids in zip(caches, new_ids, strict=True):
                keep = torch.tensor([len(ids) - 1]) if last_only else None
                logits, hidden, cache = self.forward(torch.tensor([ids]), cache, all_logits, keep=keep)
                rows.append((logits[0], hidden[0], cache))
            return rows
        stacked = stack_caches(self.model.config, caches, lens, width)
        ids = torch.zeros(len(caches), k, dtype=torch.long)  # (B, k) right-padded
        mask = torch.zeros(len(caches), width + k, dtype=torch.long)  # (B, width + k)
        for b, row in enumerate(new_ids):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, width - lens[b] : width + len(row)] = 1
        pos = torch.tensor(lens)[:, None] + torch.arange(k)[None]  # (B, k)
        sizes = torch.tensor([len(row) for row in new_ids])
        keep = sizes - 1 if last_only else None
        logits, hidden, stacked = self.forward(ids, stacked, all_logits, mask, pos, keep=keep)
        at = torch.zeros_like(sizes) if last_only else sizes - 1  # each row's last position in ``hidden``
        last = self.head(hidden[torch.arange(len(caches)), at, -1]) if not all_logits else None  # (B, V)
        out = []
        for b, n in enumerate(sizes.tolist()):
            row_logits = logits[b, :n] if last is None else last[b : b + 1]
            out.append(
                (
                    row_logits,
                    hidden[b] if last_only else hidden[b, :n],
                    row_cache(self.model.config, stacked, b, width - lens[b], width + n),
                )
            )
        return out

    def prefill(self, text: str, state: LMState | None = None) -> LMState:
        """Cache ``text`` (a full context), or extend ``state`` by ``text`` (a continuation)."""
        return self.extend(state, text)[0] if state is not None else self.prefill_many([text])[0]

    def prefill_many(self, texts: list[str]) -> list[LMState]:
        """Cache each full context in ``texts``, all in one padded forward."""
        ids = [self.text.encode(text) for text in texts]
        if any(not row for row in ids):
            raise ValueError("cannot prefill an empty context")
        for row in ids:
            if self.context_window is not None and len(row) >= self.context_window:
                raise ValueError(  # refused, never silently cut: the start of a question matters
                    f"{self.model_id}: the prompt is {len(row)} tokens and the model's context holds "
                    f"{self.context_window}; shorten the question (it is not truncated)"
                )
        outs = self.forward_rows([None] * len(texts), ids, last_only=True)
        return [
            LMState(text, row, cache, logits[-1], hidden[-1])
            for text, row, (logits, hidden, cache) in zip(texts, ids, outs, strict=True)
        ]

    def extend(
        self, state: LMState, text: str, all_logits: bool = False
    ) -> tuple[LMState, list[int], torch.Tensor, torch.Tensor]:
        """Append ``text`` to ``state`` in one prefill (mutates ``state.cache``; clone first to keep it).

        Returns the new state, the appended ids, and the outputs at the appended positions:
        logits (k, V) with ``all_logits`` else (1, V) for the last one, and hidden (k, L+1, D).
        """
        return self.extend_many([state], [text], all_logits)[0]

    def extend_many(
        self, states: list[LMState], texts: list[str], all_logits: bool = False
    ) -> list[tuple[LMState, list[int], torch.Tensor, torch.Tensor]]:
        """``extend`` for many rows in one padded forward; each row's cache is its own."""
        new_ids = [
            self.text.continuation_ids(st.text, st.ids, text) for st, text in zip(states, texts, strict=True)
        ]
        if any(not ids for ids in new_ids):
            raise ValueError("cannot extend a context by an empty string")
        outs = self.forward_rows([st.cache for st in states], new_ids, all_logits)
        return [
            (LMState(st.text + text, st.ids + ids, cache, logits[-1], hidden[-1]), ids, logits, hidden)
            for st, text, ids, (logits, hidden, cache) in zip(states, texts, new_ids, outs, strict=True)
        ]
