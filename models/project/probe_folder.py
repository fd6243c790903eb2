"""Where exported probes are, and their card: a local folder, or a Hugging Face Hub repo id fetched into the
Hub cache (the card and the probes only), and the card read from it into a ``ProbeCard``
(``semspec.models.project.probe_card`` checks that against a pair and loads the probes). It imports
huggingface_hub only when a repo id is fetched: never mlflow.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from semspec.models.project.probe_card import CARD_FILE, ProbeCard, card_from_json
from semspec.models.project.settings import settings
from semspec.models.spec.probe import CONFIG_FILE, WEIGHTS_FILE

log = logging.getLogger(__name__)

# a Hugging Face Hub repo id (``org/name``), optionally at a revision (``org/name@revision``)
_REPO_RE = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[A-Za-z0-9._/-]+))?"
)
# what a Hub snapshot of an exported folder needs (nothing else is downloaded)
HUB_PATTERNS = [CARD_FILE, f"*/{WEIGHTS_FILE}", f"*/{CONFIG_FILE}"]


def resolve_probes(source: str | Path) -> Path:
    """The local folder of exported probes ``source`` names: a folder (a ``Path`` is always one; a string
    is one when it exists), else a Hugging Face Hub repo id ``org/name`` or ``org/name@revision``, fetched
    (the card and the probes only) by ``huggingface_hub.snapshot_download`` into the Hub cache; with
    ``HF_HUB_OFFLINE`` set only the cache is read. ValueError says what to pass when it is neither, or
    when the folder holds no card."""
    text = str(source)
    local = Path(text).expanduser()
    if isinstance(source, Path) or local.exists():
        return _card_folder(local, text)
    m = _REPO_RE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"probes {text!r}: no such folder, and not a Hugging Face Hub repo id: pass a folder written by "
            f"`semspec probes export --pair <pair> DIR`, or a Hub repo id `org/name` (or `org/name@revision`)"
        )
    return _card_folder(_snapshot(m["repo"], m["revision"]), text)


def _card_folder(folder: Path, source: str) -> Path:
    """``folder`` (resolved) when it holds a card; ValueError otherwise."""
    if not folder.is_dir():
        raise ValueError(
            f"probes {source!r}: {folder} is not a folder: pass a folder written by "
            f"`semspec probes export --pair <pair> DIR`, or a Hub repo id `org/name`"
        )
    if not (folder / CARD_FILE).is_file():
        raise ValueError(
            f"probes {source!r}: {folder} holds no {CARD_FILE}: pass a folder written by "
            f"`semspec probes export --pair <pair> DIR` (or a Hub repo holding one at its top)"
        )
    return folder.resolve()


def _snapshot(repo: str, revision: str | None) -> Path:
    """The Hub repo ``repo`` at ``revision`` (default: main) in the local Hub cache, fetched unless
    ``HF_HUB_OFFLINE`` is set; ValueError saying how to get it otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    offline = settings().hub_offline
    at = f"{repo}@{revision}" if revision else repo
    try:
        path = snapshot_download(
            repo_id=repo, revision=revision, local_files_only=offline, allow_patterns=HUB_PATTERNS
        )
    except (OSError, EntryNotFoundError) as e:
        if offline:
            raise ValueError(
                f"probes {at}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set: fetch it once "
                f"where the Hub is reachable (`hf download {repo}"
                f"{f' --revision {revision}' if revision else ''}`), or pass a local folder"
            ) from None
        raise ValueError(
            f"probes {at}: could not be fetched from the Hugging Face Hub ({type(e).__name__}: {e}): check "
            f"the repo id and revision (log in with `hf auth login` for a private repo), or pass a local folder"
        ) from None
    log.info("probes %s: %s", at, path)
    return Path(path)


def read_card(folder: str | Path) -> ProbeCard:
    """The card of an exported folder (``folder/CARD_FILE``), validated: its kind and format version,
    both roles for every probe key, every path inside the folder. ValueError names what is wrong."""
    folder = Path(folder)
    path = folder / CARD_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder} holds no {CARD_FILE}: pass a folder written by `semspec probes export --pair <pair> DIR`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}): export the probes again") from None
    return card_from_json(data, str(path), folder)


SHIPPED_DIR = "probes"  # in the project (the repository, or the installed package): <pair>/ per pair


def shipped_probes(pair: str) -> Path | None:
    """The exported folder of ``pair``'s probes that ships with semspec (``probes/<pair>/``, package data
    of an installed semspec), or None where none ships."""
    folder = settings().project_dir / SHIPPED_DIR / pair
    return folder if (folder / CARD_FILE).is_file() else None
