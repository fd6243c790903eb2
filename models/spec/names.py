"""The algorithm's vocabulary: every name of a method, a model role or a probe that more than one module
spells is defined here, once (the pipeline's names are in ``semspec.models.project.names``).

Method names, probe variants and keys, and the ``semanticspec-<variant>`` label that evaluation and the
bench print.

A probe is named by its variant, and by a data domain when it was trained on one domain only (the paper's
5.4 cross-domain study): the key ``<variant>@<domain>`` (e.g. ``all@math``), registered as
``semspec-<pair>-<role>-<variant>-<domain>``. A probe trained on every domain has the plain variant key.
"""

from __future__ import annotations

import re

METHODS = ("target", "draft", "specsampling", "assisted", "specreason", "semanticspec")
# not semspec's decoders: llama.cpp's llama-server on the target's GGUF file, the baseline a CPU user runs
# (``semspec bench --llamacpp``, and an evaluation method named in ``evaluate.methods``, never by default)
LLAMACPP = "llamacpp"
PROBE_METHOD = "semanticspec"  # the method that reads the registered probes
# the evaluate settings only SemanticSpec reads (its acceptance rule): part of its run identity, not of the
# other methods' run keys
SEMANTICSPEC_RULES = ("min_ratio", "min_p", "max_rejections", "min_token_p")
STEP_METHODS = ("semanticspec", "specreason")  # the methods that verify whole draft steps (step acceptance)
PROBE_VARIANTS = ("random", "last", "all", "mix")  # random: the paper's baseline probe
ROLES = ("draft", "target")
# the pooled hidden states each trained probe variant reads: a field of ``semspec.models.lm.Pooled`` and the
# sample stage's Parquet column of that name (``random`` reads nothing)
FEATURE_COLUMNS = {"last": "h_last", "all": "h_mean", "mix": "h_layers"}
# min_ratio and min_p (evaluate and DecodeSettings): the floor the probe pair's train run chose on validation
FLOOR_AUTO = "auto"
GAMMA_AUTO = "auto"  # gamma chosen from the probes' acceptance (``semspec.models.spec.settings.gamma_for``)
ALL_DOMAINS = "all"  # the probes trained on every domain's data (keys and names without a domain)
_DOMAIN_RE = re.compile(r"[A-Za-z0-9_.]+")


def check_domain(domain: str) -> str:
    """``domain`` when it can name a probe (letters, digits, ``_`` and ``.``); ValueError otherwise."""
    if not isinstance(domain, str) or not _DOMAIN_RE.fullmatch(domain):
        raise ValueError(f"domain {domain!r} must be letters, digits, '_' or '.' (e.g. math, science)")
    return domain


def probe_key(variant: str, domain: str | None = None) -> str:
    """``<variant>`` for a probe trained on every domain, ``<variant>@<domain>`` for one domain's."""
    if variant not in PROBE_VARIANTS:
        raise ValueError(f"unknown probe variant {variant!r}; expected one of {PROBE_VARIANTS}")
    if domain is None or domain == ALL_DOMAINS:
        return variant
    return f"{variant}@{check_domain(domain)}"


def split_probe_key(key: str) -> tuple[str, str | None]:
    """``(variant, domain)`` of a ``probe_key`` (domain None for every domain); ValueError otherwise."""
    variant, sep, domain = key.partition("@")
    probe_key(variant, domain if sep else None)  # raises on anything probe_key would not make
    return variant, domain if sep else None


def method_label(method: str, variant: str | None = None) -> str:
    """The label of one decoder: ``semanticspec-<probe key>`` for SemanticSpec (``semanticspec-all``,
    ``semanticspec-all@math``), else the method name (``llamacpp`` too)."""
    if method not in (*METHODS, LLAMACPP):
        raise ValueError(f"unknown method {method!r}; expected one of {(*METHODS, LLAMACPP)}")
    if method != PROBE_METHOD:
        return method
    if variant is None:
        raise ValueError(f"{PROBE_METHOD} needs a probe variant; expected one of {PROBE_VARIANTS}")
    split_probe_key(variant)
    return f"{method}-{variant}"


def parse_label(label: str) -> tuple[str, str | None]:
    """``(method, variant)`` of a label made by ``method_label`` (``variant`` is None without probes)."""
    method, _, variant = label.partition("-")
    method_label(method, variant or None)  # raises on anything method_label would not make
    return method, variant or None
