"""Loading an ``LM`` from a model config (Hub id, local folder or packaged GGUF) in the format its ``dtype``
resolves to here, and the cache of GGUF files converted to the Hugging Face format."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel

from semspec.models.cpu import attention, decode_layer
from semspec.models.cpu.formats import Format, quantize_model, resolve_format
from semspec.models.lm import weight_cache
from semspec.models.lm.adapter import LM, dtype_name
from semspec.models.lm.pair import ModelConfig
from semspec.models.lm.weights import (
    converted_cache_path,
    converted_enabled,
    converted_key,
    resolve_model,
    stale_converted,
)

log = logging.getLogger(__name__)


def install_kernels(model: PreTrainedModel) -> PreTrainedModel:
    """Route a CPU model's decoding calls through semspec's kernels: one query per row attends in the
    decode attention kernel (``models/cpu/attention.py``), and Llama/Qwen2 decoder layers decode whole
    (``models/cpu/decode_layer.py``). ``load_lm`` does it once per model, after quantizing; a model built
    in memory (tests, benchmarks) calls it before wrapping the model in an ``LM``. Returns ``model``."""
    if next(model.parameters()).device.type == "cpu":
        attention.use_decode_attention(model)
        decode_layer.install(model)
    return model


def pick_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _placement(model_cfg: ModelConfig) -> dict:
    """``from_pretrained`` keywords that load the weights straight onto the model config's device (no full copy
    in CPU memory first); none for the CPU, the default."""
    device = pick_device(model_cfg.device)
    return {} if device.type == "cpu" else {"device_map": str(device)}


class _NotShardedNoise(logging.Filter):
    """transformers 5 checks a model's tensor-parallel plan at every load and warns that its layers "were
    not sharded", although nothing here shards a model: that line is dropped, every other one kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "were not sharded" not in record.getMessage()


_TP_LOGGER = "transformers.distributed.tensor_parallel"


_SOURCE = "semspec-source.json"  # in a converted copy: the key of the GGUF file it was made from


def gguf_path(where: str, gguf_file: str) -> Path | None:
    """The GGUF file on disk: in a folder, or in the local Hub cache (None when not downloaded yet)."""
    local = Path(where) / gguf_file
    if local.is_file():
        return local
    cached = try_to_load_from_cache(where, gguf_file)
    return Path(cached) if isinstance(cached, str) else None


def _converted_folder(model_cfg: ModelConfig, where: str, dtype: torch.dtype) -> tuple[Path, dict] | None:
    """(folder, key) of the converted copy of ``model_cfg``'s GGUF file in ``dtype``, or None without one
    (cache off, or the file not on disk yet)."""
    if not (model_cfg.gguf_file and converted_enabled()):
        return None
    path = gguf_path(where, model_cfg.gguf_file)
    if path is None:
        return None
    # resolve_model checked it (not a Hub file)
    verified = model_cfg.sha256 if model_cfg.source != "hub" else None
    key = converted_key(path, dtype_name(dtype), verified, f"transformers=={transformers.__version__}")
    return converted_cache_path(model_cfg.model_id, key), key


def _load_converted(folder: Path, key: dict, model_cfg: ModelConfig, dtype: torch.dtype) -> tuple | None:
    """(tokenizer, model) from a converted copy made for ``key``; None when there is none. A copy that does
    not load (cut by a full disk, edited) is deleted, so the caller converts the GGUF file again."""
    if not (folder / _SOURCE).is_file():
        return None
    try:
        if json.loads((folder / _SOURCE).read_text()) != key:
            raise ValueError("it was made from another file")
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=model_cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code, **_placement(model_cfg)
        )
    except (ValueError, RuntimeError, OSError, KeyError, SafetensorError) as e:
        log.warning(
            "%s: converted copy %s unusable (%s): deleting it, converting the GGUF file again",
            model_cfg.model_id,
            folder,
            e,
        )
        shutil.rmtree(folder, ignore_errors=True)
        return None
    log.info("%s: loaded the converted copy of its GGUF file from %s", model_cfg.model_id, folder)
    return tokenizer, model


def _save_converted(folder: Path, key: dict, tokenizer, model: PreTrainedModel) -> None:
    """Keep ``model`` and ``tokenizer`` (just converted from GGUF) in ``folder``: written under a temporary
    name and renamed when complete, so a crash or a full disk never leaves a half copy that looks whole.
    Older copies of the same model and dtype are removed. A failure only costs the next load its speed."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE).write_text(json.dumps(key))
        for old in stale_converted(folder):
            shutil.rmtree(old, ignore_errors=True)
        if not folder.exists():  # another process may have kept the same copy meanwhile
            os.rename(tmp, folder)
        log.info("kept the converted GGUF model in %s (SEMSPEC_GGUF_CACHE=0 turns this off)", folder)
    except OSError as e:
        log.warning(
            "could not keep a converted copy in %s (%s): the next load converts the GGUF file again",
            folder,
            e,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_lm(model_cfg: ModelConfig) -> LM:
    """Load tokenizer + causal LM described by ``model_cfg`` (Hub id, local folder or packaged GGUF), in the
    format its ``dtype`` resolves to on this machine (``semspec.models.cpu.formats``).

    A GGUF model is converted (dequantized to the format's load dtype) once and kept in the cache in the
    Hugging Face format, keyed by the file and the dtype (about a minute for the embedded target here). In
    an int format, its quantized and packed weights are kept too (``weight_cache``): later loads
    memory-map them into modules built without memory, with no bfloat16 copy on the way, in about a
    second. Other models are quantized as they load (seconds; logged)."""
    t0 = time.perf_counter()
    tp_log = logging.getLogger(_TP_LOGGER)
    if not any(isinstance(f, _NotShardedNoise) for f in tp_log.filters):
        tp_log.addFilter(_NotShardedNoise())
    fmt = resolve_format(model_cfg.dtype, model_cfg.device)
    where = resolve_model(model_cfg)
    converted = _converted_folder(model_cfg, where, fmt.load_dtype)
    cached = _weight_entry(model_cfg, fmt, converted)
    loaded = weight_cache.load(*cached, fmt, model_cfg.trust_remote_code) if cached else None
    if loaded is None:
        loaded = _load_and_quantize(model_cfg, where, fmt, converted)
        cached = cached or _weight_entry(model_cfg, fmt, _converted_folder(model_cfg, where, fmt.load_dtype))
        if cached:  # kept, then mapped from the file: every process runs the same tensors, shared
            weight_cache.save(*cached, *loaded)
            loaded = weight_cache.load(*cached, fmt, model_cfg.trust_remote_code) or loaded
    else:
        log.info("%s: quantized weights memory-mapped from %s", model_cfg.model_id, cached[0])
    tokenizer, model = loaded
    lm = LM(install_kernels(model), tokenizer, model_cfg, fmt)
    lm.load_seconds = time.perf_counter() - t0
    log.info("%s runs in %s", model_cfg.model_id, fmt.describe())
    return lm


def _weight_entry(
    model_cfg: ModelConfig, fmt: Format, converted: tuple[Path, dict] | None
) -> tuple[Path, dict] | None:
    """(folder, key) of the weight cache's entry for a quantized GGUF model on the CPU, else None."""
    if converted is None or not fmt.quantized or pick_device(model_cfg.device).type != "cpu":
        return None
    key = weight_cache.cache_key(converted[1], fmt)
    return weight_cache.entry_path(model_cfg.model_id, key), key


def _load_and_quantize(
    model_cfg: ModelConfig, where: str, fmt: Format, converted: tuple[Path, dict] | None
) -> tuple:
    """(tokenizer, model) from the converted copy or the source, quantized to ``fmt`` where it says so."""
    loaded = _load_converted(*converted, model_cfg, fmt.load_dtype) if converted else None
    if loaded is None:
        loaded = _load_pretrained(model_cfg, where, fmt.load_dtype)
        # a Hub GGUF is on disk now
        converted = converted or _converted_folder(model_cfg, where, fmt.load_dtype)
        if converted:
            _save_converted(*converted, *loaded)
    tokenizer, model = loaded
    model.to(pick_device(model_cfg.device))  # a no-op where from_pretrained placed it already
    if fmt.quantized:
        tq = time.perf_counter()
        n = quantize_model(model, fmt)
        log.info(
            "%s: %d linear layers quantized to %s in %.1f s",
            model_cfg.model_id,
            n,
            fmt.name,
            time.perf_counter() - tq,
        )
    return tokenizer, model


def _load_pretrained(model_cfg: ModelConfig, where: str, dtype: torch.dtype) -> tuple:
    """(tokenizer, model) by ``from_pretrained`` from ``where`` (a Hub id or a folder, with the GGUF file)."""
    kw: dict = {"trust_remote_code": model_cfg.trust_remote_code}
    if model_cfg.gguf_file:
        kw["gguf_file"] = model_cfg.gguf_file
    log.info("loading %s from %s", model_cfg.model_id, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
        # GGUF weights are unpacked into dense ``dtype`` tensors: said explicitly, so transformers does not
        # warn that packed weights would run in float32 (they are not kept packed for these architectures,
        # nor without `kernels`); the int formats quantize them again afterwards (``quantize_model``)
        extra = {"quantization_config": GgufConfig(dequantize=True)} if model_cfg.gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, **kw, **extra, **_placement(model_cfg)
        )
    except (ValueError, RuntimeError, OSError, KeyError, IndexError) as e:
        if not model_cfg.gguf_file:
            raise
        # a cut GGUF file surfaces as a reshape or read error deep in the converter: name the file
        path = Path(where) / model_cfg.gguf_file
        raise ValueError(
            f"{model_cfg.model_id}: cannot read the GGUF file {path} ({type(e).__name__}: {e}); it is probably "
            f"truncated or corrupt: pin its sha256 in the pair file to have it checked, or reinstall the "
            f"package that provides it"
        ) from e
    return tokenizer, model
