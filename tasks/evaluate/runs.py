"""What evaluation results were made with, and resuming: the run key of a per-problem row (rows with another
key are decoded again) and the identity of a finished evaluation (what ``pairs status`` compares)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import LLAMACPP, PROBE_METHOD, SEMANTICSPEC_RULES, parse_label
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import EvaluateConfig, Params
from semspec.tasks.fingerprint import pipeline_fingerprint
from semspec.tasks.io import atomic_path, config_hash

log = logging.getLogger(__name__)


# the decode settings that were evaluate's own fields before the decode section grouped them: always in a
# row's key; the others only where they differ from their default, so earlier rows keep their keys
_KEYED = ("max_new_tokens", "temperature", "top_p", "gamma", "lookahead", "rewrite_wait", *SEMANTICSPEC_RULES)
# the settings one method alone reads: not in the other methods' keys
_READ_BY = {"salvage": PROBE_METHOD, "accept_threshold": "specreason"}


def _decode_key(decode: DecodeSettings) -> dict[str, Any]:
    default = DecodeSettings()
    return {k: v for k, v in decode.configured().items() if k in _KEYED or v != getattr(default, k)}


def run_key(
    cfg: EvaluateConfig, pair: PairConfig, label: str, identity: Any, formats: dict[str, str] | None = None
) -> str:
    """What a per-problem row depends on besides its problem and seed: the decoding settings, the pair file,
    the formats its models run in here (``auto`` resolves per machine) and, for SemanticSpec, its
    ``run_identity`` (probe versions, salvage). Rows with another key are stale
    and decoded again. The number of actors is not part of it (a row does not depend on which replica
    decoded it); the batch size is (latencies do). The probe domain is in SemanticSpec's label and its
    probes' identity, not in the key of the other methods' rows; neither is llama.cpp's binary, nor the floors on p/q and on p,
    the rejection budget and the token check, which only SemanticSpec reads (so its rows with and without them share the
    same baseline rows)."""
    skip = {"benchmarks", "methods", "probe_variants", "seeds", "actors", "probe_domain", "decode"}
    method = parse_label(label)[0]
    if method != PROBE_METHOD:
        skip |= set(SEMANTICSPEC_RULES)
    skip |= {name for name, reader in _READ_BY.items() if reader != method}
    settings = {k: v for k, v in {**asdict(cfg), **_decode_key(cfg.decode)}.items() if k not in skip}
    if method != LLAMACPP:  # only llama.cpp's rows depend on its binary (kept as unset: earlier keys stay)
        settings["llamacpp_bin"] = None
    # a rule that is off is left out, as before it existed, so earlier rows keep their keys (min_ratio was
    # in the key from the start)
    for name in (r for r in SEMANTICSPEC_RULES if r != "min_ratio"):
        if settings.get(name) is None:
            settings.pop(name, None)
    pair_fields = {k: v for k, v in asdict(pair).items() if k != "description"}
    return config_hash(
        {
            "evaluate": settings,
            "pair": pair_fields,
            "label": label,
            "probes": identity,
            **({"formats": formats} if formats else {}),
        }
    )


def resume_rows(path: Path, key: str) -> list[dict[str, Any]]:
    """The rows of ``path`` made with ``key``; the file is rewritten (atomically) without the others."""
    if not path.is_file():
        return []
    rows, stale = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash
            stale += 1
            continue
        if row.get("run_key") == key:
            rows.append(row)
        else:
            stale += 1
    if stale:
        log.info("evaluate: %s: dropping %d rows of other settings (or cut by a crash)", path, stale)
        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows), encoding="utf-8")
    return rows


RUN_KEY = "_run"  # in the stage's metrics file: what the finished evaluation was run on


def evaluation_identity(params: Params, pair: PairConfig, pins: dict[str, str] | None) -> dict[str, Any]:
    """What a finished evaluation of ``pair`` depends on: the probes' fingerprint (pair file, data,
    pipeline params), the evaluation settings and the probe versions it loaded."""
    return {
        **pipeline_fingerprint(params, pair),
        "evaluate_hash": config_hash(asdict(params.evaluate)),
        "split_strategy": params.split_strategy,
        "probes": dict(sorted((pins or {}).items())),
    }
