"""How ``semspec serve`` runs: :class:`ServeConfig`, checked before any model loads, and the threshold up to
which SemanticSpec speculates (``--spec-max-batch``: measured per CPU kind in ``conf/serving.yaml``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from semspec.models.project.settings import HOST


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs; checked before any model loads."""

    host: str = HOST  # loopback by default; another address needs an api_key
    port: int = 8000
    api_key: str | None = None  # required as ``Authorization: Bearer <key>`` by every path but /health
    max_batch: int = 8  # rows decoded at once
    max_queue: int = 64  # requests that may wait for a row (>= 1); one more is answered 429
    spec_max_batch: int | None = None  # SemanticSpec speculates while at most this many are in flight
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for
    default_max_tokens: int | None = None  # a request without max_tokens (None: the evaluation's budget)
    # what a request may be, checked before it reaches the engine (413 / 400)
    max_body_bytes: int = 1 << 20  # a request body's bytes
    max_messages: int = 256  # a chat's messages
    max_prompt_chars: int = 200_000  # a prompt's characters, every message together
    max_prompt_tokens: int = 4096  # a prompt's tokens (in either model)
    # what the batch may hold: prompt tokens + max_tokens of every row in it (None: max_batch rows of
    # max_prompt_tokens + max_tokens_limit); a request waits until its tokens fit
    max_batch_tokens: int | None = None
    prompt_workers: int = 2  # threads that render and tokenize prompts, beside the engine's thread
    # connections: uvicorn's limits, and the time a client has to send its whole body
    limit_concurrency: int = 256  # open connections; one more is answered 503
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open
    body_timeout: float = 10.0  # seconds to receive a request's body; a slower client gets 408
    public_metrics: bool = False  # /metrics without the api key (a scraper on a trusted network)

    def uvicorn_options(self) -> dict[str, int]:
        """The connection limits uvicorn enforces (one more open connection is answered 503)."""
        return {"limit_concurrency": self.limit_concurrency, "timeout_keep_alive": self.timeout_keep_alive}

    @property
    def batch_tokens(self) -> int:
        """The batch's token budget (``max_batch_tokens``, or room for ``max_batch`` of the largest rows)."""
        return self.max_batch_tokens or self.max_batch * (self.max_prompt_tokens + self.max_tokens_limit)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        counts = {
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "max_tokens_limit": self.max_tokens_limit,
            "max_body_bytes": self.max_body_bytes,
            "max_messages": self.max_messages,
            "max_prompt_chars": self.max_prompt_chars,
            "max_prompt_tokens": self.max_prompt_tokens,
            "prompt_workers": self.prompt_workers,
            "limit_concurrency": self.limit_concurrency,
            "timeout_keep_alive": self.timeout_keep_alive,
        }
        bad = [f"{k}={v}" for k, v in counts.items() if v < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: each must be >= 1")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 2:
            raise ValueError(
                f"max_batch_tokens must be >= 2 (a prompt token and a new one), got {self.max_batch_tokens}"
            )
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 seconds, got {self.body_timeout}")
        if self.default_max_tokens is not None and not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(f"default_max_tokens must be in 1..{self.max_tokens_limit}")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"--host {self.host} exposes the server beyond this machine: give --api-key KEY (clients "
                f"send it as 'Authorization: Bearer KEY'), or keep the default --host {HOST}"
            )


def cpu_kind() -> str:
    """``amx``, ``avx512_bf16`` or ``avx2``: the kinds whose serving threshold differs."""
    from semspec.models.cpu.cpuinfo import cpu_info

    cpu = cpu_info()
    return "amx" if cpu.amx else ("avx512_bf16" if cpu.native_bf16 else "avx2")


def auto_spec_max_batch(kind: str | None = None) -> int:
    """The serving threshold measured for this CPU kind (``conf/serving.yaml``)."""
    import yaml

    from semspec.models.project.pairs import project_root

    path = project_root() / "conf" / "serving.yaml"
    table = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("spec_max_batch", {})
    kind = kind or cpu_kind()
    if kind not in table:
        raise ValueError(f"{path}: no spec_max_batch for the CPU kind {kind!r}; add it, or pass a number")
    return int(table[kind])


def parse_spec_max_batch(value: str) -> int | None:
    """``auto`` (this CPU kind's measured threshold), ``always`` (never switch off) or a count >= 0."""
    if value == "auto":
        return auto_spec_max_batch()
    if value == "always":
        return None
    if not value.isdigit():
        raise ValueError(f"--spec-max-batch must be auto, always or a count >= 0, got {value!r}")
    return int(value)


def read_key_file(path: Path) -> str:
    """The API key in ``path`` (its first line, stripped); ValueError when the file is missing or empty."""
    try:
        key = path.read_text(encoding="utf-8").strip().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    if not key or not key[0].strip():
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return key[0].strip()


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
