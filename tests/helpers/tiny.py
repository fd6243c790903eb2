"""Tiny models and tokenizers built from a config: no checkpoint, no network, milliseconds."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from semspec.models.lm import LM, install_kernels
from semspec.models.lm.pair import ModelConfig

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
MERGED = ["\n\n", ".\n\n", ".\n\nT"]  # tokens that carry the delimiter, one of them followed by text


def char_tokenizer(merged: bool = False) -> PreTrainedTokenizerFast:
    """A character tokenizer; with ``merged`` it also has tokens containing the ``\\n\\n`` delimiter."""
    vocab_list = SPECIAL + CHARS + (MERGED if merged else [])
    vocab = {t: i for i, t in enumerate(vocab_list)}
    merges = [("\n", "\n"), (".", "\n\n"), (".\n\n", "T")] if merged else []
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def tiny_llama(
    vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 32, init: float = 0.02
) -> LlamaForCausalLM:
    """A randomly initialised Llama with a few layers (a larger ``init`` makes its outputs depend more
    on the context)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=init,
    )
    return LlamaForCausalLM(cfg).eval()


def boost_tokens(model: LlamaForCausalLM, token_ids: list[int], bias: float) -> None:
    """Give the output head a bias so that ``token_ids`` are sampled often (e.g. the delimiter)."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[token_ids] = bias
    model.lm_head = head


def tiny_lm(
    merged: bool = False,
    seed: int = 0,
    max_step_tokens: int = 24,
    boost: float = 0.0,
    hidden: int = 32,
    init: float = 0.02,
    eos_bias: float = 0.0,
    pooling: str = "predict",
    **model_cfg,
) -> LM:
    """An LM adapter over a tiny random Llama and a character tokenizer; ``boost`` and ``eos_bias`` make
    the delimiter and EOS likelier; ``pooling`` is the pair's (see models/lm/__init__.py)."""
    tok = char_tokenizer(merged)
    model = tiny_llama(len(tok), seed=seed, hidden=hidden, init=init)
    if boost or eos_bias:
        ids = tok.convert_tokens_to_ids(MERGED if merged else ["\n"])
        boost_tokens(model, ids, boost)
        with torch.no_grad():
            model.lm_head.bias[tok.eos_token_id] = eos_bias
    model_cfg = {"prompt": "plain", **model_cfg}
    s = ModelConfig(
        model_id=f"tiny-llama-{seed}",
        source="local",
        path="/nonexistent",
        max_step_tokens=max_step_tokens,
        **model_cfg,
    )
    s.pooling = pooling
    return LM(install_kernels(model), tok, s)


def tiny_gemma_lm(sliding_window: int = 16, seed: int = 2, max_step_tokens: int = 8) -> LM:
    """An LM adapter over a tiny random Gemma-3 with one sliding-window layer and one global layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = char_tokenizer()
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    model_cfg = ModelConfig(
        model_id=f"tiny-gemma-{seed}",
        source="local",
        path="/nonexistent",
        prompt="plain",
        max_step_tokens=max_step_tokens,
    )
    return LM(install_kernels(model), tok, model_cfg)
