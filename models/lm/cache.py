"""KV-cache operations of the LM adapter: window checks, cropping, and stacking per-row caches into one
left-padded batch cache and splitting a row back out."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


def fits_window(cache: Cache | None, length: int) -> bool:
    """Whether ``cache`` can hold ``length`` positions with every one still in it: no sliding-window layer
    would have dropped any, so a crop can bring back any shorter context."""
    for layer in getattr(cache, "layers", []):
        window = getattr(layer, "sliding_window", None)
        if window is not None and length >= int(window) - 1:
            return False
    return True


def crop_to(cache: Cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` positions (nothing when it is not longer)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def stackable(caches: list[Cache | None], layout: Cache, length: int) -> bool:
    """Whether these caches can be stacked into one padded batch of ``length`` positions: plain or
    sliding-window attention layers only, and no window that padding would overflow (``layout``: an empty
    cache of the model's layer types)."""
    for cache in caches:
        if cache is None:
            continue
        if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
            return False
        if not fits_window(cache, length):
            return False
    return fits_window(layout, length)


def stack_caches(config: PretrainedConfig, caches: list[Cache | None], lens: list[int], width: int) -> Cache:
    """One cache holding every row left-padded to ``width`` positions: (B, H, width, Dh) per layer."""
    stacked = DynamicCache(config=config)
    ref = next((c for c, n in zip(caches, lens, strict=True) if n), None)
    if ref is None:
        return stacked
    for i, layer in enumerate(ref.layers):
        keys, values = [], []
        for cache, n in zip(caches, lens, strict=True):
            k = cache.layers[i].keys if n else layer.keys[:1, :, :0]  # (1, H, n, Dh)
            v = cache.layers[i].values if n else layer.values[:1, :, :0]
            keys.append(torch.nn.functional.pad(k, (0, 0, width - n, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, width - n, 0)))
        stacked.update(torch.cat(keys), torch.cat(values), i)
    return stacked


def row_cache(config: PretrainedConfig, stacked: Cache, b: int, start: int, end: int) -> Cache:
    """Row ``b`` of a stacked cache, positions ``start:end`` (its own tokens), as a cache of its own."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(stacked.layers):
        cache.update(layer.keys[b : b + 1, :, start:end], layer.values[b : b + 1, :, start:end], i)
    return cache
