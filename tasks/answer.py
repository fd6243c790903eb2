"""`semspec decode`: one question answered by one method, as the evaluation decodes (its settings, with
the command's options in place of its budget, temperature, gamma and seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from semspec.models.spec.names import PROBE_METHOD, ROLES
from semspec.models.spec.results import DecodeResult
from semspec.tasks.config import Params


def open_decoder(
    params: Params,
    pair_name: str,
    method: str,
    probe: str,
    probes_dir: Path | None = None,
    **options: Any,
) -> Any:
    """The decoder of ``method`` on ``pair_name`` (``probe``: the registered probe variant SemanticSpec
    loads, ``<variant>@<domain>`` for one domain's; with ``probes_dir``, a folder of exported probes, that
    variant's probes from there instead of the registry). ``options`` replace fields of the evaluation's
    settings. The probes are checked before any model loads (a minute on a CPU); ValueError says what is
    missing."""
    from semspec.models.lm import load_lm
    from semspec.models.project.pairs import load_pair
    from semspec.tasks import decoders

    pair = load_pair(pair_name, None, params.split_strategy)
    settings = decoders.decode_settings(params.evaluate, **options)
    if method == PROBE_METHOD:
        decoders.check_probes(pair, probe, probes_dir)
    lms = {r: load_lm(pair.role(r)) for r in ([method] if method in ROLES else ROLES)}
    pins = None  # the champions (or the folder's probes)
    return decoders.build_decoder(method, pair, lms, settings, probe, pins, probes_dir)


def summary_line(res: DecodeResult) -> str:
    """Tokens, time, throughput, the target's share of the tokens and the step acceptance of one answer."""
    acc = "n/a" if res.acceptance_rate is None else f"{res.acceptance_rate:.2f}"
    return (
        f"{res.output_tokens} tokens in {res.timings.total:.1f}s ({res.tokens_per_second:.1f} tok/s), "
        f"target share {res.target_share:.2f}, step acceptance {acc}"
    )
