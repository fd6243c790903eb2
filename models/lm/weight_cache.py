"""The weight cache: a model's quantized, packed weights kept on disk, memory-mapped at load.

Quantizing and packing a model's linear layers costs seconds per load, and the
path to them goes through a bfloat16 copy of the whole model. So once a model has been quantized, every
tensor it holds is written to one safetensors file, keyed by what they depend on: the GGUF file's content
(its sha256, or its path, size and mtime when the pair file pins none), the format, the kernels' packed
layouts (``LAYOUT_VERSION``, and whether each kernel runs here) and the torch and transformers versions.
A later load builds the model's modules without memory (``torch.device("meta")``) and points them at the
file's tensors, memory-mapped: no bfloat16 copy is made, the pages are shared by every process that maps
the same entry (sample actors, evaluation workers, the API and the server), and the model loads in the
time it takes to read its config.

An entry is written under a temporary name and renamed when whole. One whose key file differs (stale) or
that does not load (cut, edited, another layout) is deleted and rebuilt, never used; a new entry replaces
those of the same model made from another GGUF file. ``SEMSPEC_GGUF_CACHE=0``
turns it off with the converted copies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from semspec.models.cpu import int4_kernel, int8_kernel
from semspec.models.cpu.formats import Format, QuantLinear
from semspec.models.lm.weights import cache_dir, safe_name

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when a kernel's packed layout or QuantLinear's tensors change
_KEY = "semspec-key.json"
_TENSORS = "model.safetensors"
_LAYERS = "semspec_quantized_layers"  # safetensors metadata: {layer name: QuantLinear.stored_layout()}


def cache_key(source: dict, fmt: Format) -> dict:
    """What an entry depends on: ``source`` (the converted copy's key: the GGUF file's content and the
    converter), the format, the packed layouts the kernels here take, and the versions that read them."""
    int8 = int8_kernel.int8_mm()
    return {
        "source": source,
        "format": fmt.label(),
        "layout": LAYOUT_VERSION,
        "int4_kernel": int4_kernel.int4_mm() is not None,
        "int8_kernel": None if int8 is None else int8.isa,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def entry_path(model_id: str, key: dict) -> Path:
    """``<cache>/quantized/<model id>-<format name>-<digest of key>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = key["format"].split(" ")[0]
    return cache_dir() / "quantized" / f"{safe_name(model_id)}-{name}-{digest}"


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer ``model`` holds (non-persistent ones too: a model built on the meta
    device has none of its own), but QuantLinear's dense copy, which is rebuilt from the int weights."""
    seen: set[str] = set()
    for module_name, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for name, t in kind.items():
                full = f"{module_name}.{name}" if module_name else name
                if t is None or full in seen or (isinstance(module, QuantLinear) and name == "dense"):
                    continue
                seen.add(full)
                yield full, t.detach()


def save(folder: Path, key: dict, tokenizer, model: PreTrainedModel) -> None:
    """Write the quantized ``model`` (and its tokenizer and config) as the entry for ``key``; a failure
    (a full disk) is logged and only costs the next load its speed."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        owners: dict[tuple[int, int], str] = {}
        for name, t in _tensors(model):
            # safetensors refuses tensors that share memory (tied weights, aliased buffers): copy those
            where = (t.untyped_storage().data_ptr(), t.storage_offset())
            tensors[name] = t.clone().contiguous() if where in owners else t.contiguous()
            owners.setdefault(where, name)
        layers = {n: m.stored_layout() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        save_file(tensors, str(tmp / _TENSORS), metadata={_LAYERS: json.dumps(layers)})
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _KEY).write_text(json.dumps(key))
        for old in _superseded(folder, key):
            shutil.rmtree(old, ignore_errors=True)
        if folder.exists():  # another process wrote the same entry meanwhile: it serves
            return
        os.rename(tmp, folder)
        log.info("kept the quantized weights in %s", folder)
    except (OSError, RuntimeError, ValueError) as e:
        log.warning(
            "could not keep the quantized weights in %s (%s): the next load quantizes again", folder, e
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _superseded(folder: Path, key: dict) -> list[Path]:
    """The entries of the same model and format name made from another GGUF file (the file changed):
    ``folder``'s entry replaces them. Entries of the same file for other kernels, format rules or versions
    stay, since another setting or environment on this machine may map them."""
    out = []
    for other in folder.parent.glob(f"{folder.name.rsplit('-', 1)[0]}-*"):
        if other == folder or not other.is_dir() or ".tmp" in other.name:
            continue
        try:
            source = json.loads((other / _KEY).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            source = None  # unreadable: not a whole entry of this layout
        if source != key["source"]:
            out.append(other)
    return out


def load(folder: Path, key: dict, fmt: Format, trust_remote_code: bool = False) -> tuple | None:
    """(tokenizer, model) from the entry for ``key``, its tensors memory-mapped; None without a usable
    one. A stale or broken entry (another key, a cut or unreadable file, tensors that do not fit) is
    deleted (logged) so the caller rebuilds it; an error of this process (out of memory, too many open
    files) only makes the caller quantize again, leaving the entry."""
    if not (folder / _KEY).is_file():
        return None
    try:
        if json.loads((folder / _KEY).read_text()) != key:
            raise ValueError("it was made for another file, format or layout")
        return _load(folder, fmt, trust_remote_code)
    except (ValueError, KeyError, SafetensorError) as e:
        log.warning("quantized weights in %s unusable (%s): deleting them, quantizing again", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    except (OSError, RuntimeError, TypeError) as e:
        log.warning("could not map the quantized weights in %s (%s): quantizing again", folder, e)
        return None


def _load(folder: Path, fmt: Format, trust_remote_code: bool) -> tuple:
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):  # modules without memory: every tensor comes from the file
        model = AutoModelForCausalLM.from_config(
            config, dtype=fmt.load_dtype, trust_remote_code=trust_remote_code
        )
    with safe_open(str(folder / _TENSORS), framework="pt") as f:
        names = set(f.keys())
        layers = json.loads((f.metadata() or {})[_LAYERS])
        for name, layout in layers.items():
            parent, _, child = name.rpartition(".")
            bias = f.get_tensor(f"{name}.bias") if f"{name}.bias" in names else None
            q, scales = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales")
            _check_stored(name, model.get_submodule(name), layout, q, bias)
            layer = QuantLinear.from_stored(fmt, layout, q, scales, bias)
            model.get_submodule(parent).register_module(child, layer)
        for name, t in list(_tensors(model)):
            if t.is_meta:
                if name not in names:
                    raise KeyError(f"the file lacks {name}")
                _assign(model, name, f.get_tensor(name))
    if folder.joinpath("generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return tokenizer, model.eval()


def _check_stored(
    name: str, module: nn.Module, layout: dict, q: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """A stored quantized layer must fit the module it replaces before a kernel reads it by pointer: its
    widths are the module's, its packed weights hold exactly in x out x bits, its bias is (out,).
    ValueError (the entry is deleted and rebuilt) otherwise."""
    n_in, n_out, bits = int(layout["in"]), int(layout["out"]), int(layout["bits"])
    want = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    if (n_in, n_out) != want:
        raise ValueError(f"{name}: stored widths {(n_in, n_out)}, the model's layer {want}")
    if q.numel() * q.element_size() * 8 != n_in * n_out * bits:
        raise ValueError(
            f"{name}: stored weights of {q.numel()} x {q.dtype} do not hold {n_out} x {n_in} x {bits} bits"
        )
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"{name}: stored bias of shape {tuple(bias.shape)}, the layer has {n_out} outputs")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point parameter or buffer ``name`` of ``model`` at ``tensor``, in the dtype the saved model held it
    (a shape that differs from the module's is an error)."""
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent)
    old = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
    if old.shape != tensor.shape:
        raise ValueError(f"{name}: the file holds shape {tuple(tensor.shape)}, the model {tuple(old.shape)}")
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor
