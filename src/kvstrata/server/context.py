"""What every route needs: the server's config, and the one engine and store it serves."""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.engine import Engine
from kvstrata.errors import ConfigError
from kvstrata.server.audit import AuditLog
from kvstrata.server.auth import ApiKeys
from kvstrata.server.metrics import ServerMetrics
from kvstrata.store import KVStore

# A GGUF file's quantisation suffix ("SmolLM2-135M-Instruct.Q4_1", "...-Q8_0", ".F16"): clients name
# the model without it, as its model card does.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|[BF]F?16|F32)$", re.IGNORECASE)


def model_names(model_name: str) -> frozenset[str]:
    """The names a request may use for the model served as ``model_name``: itself, and itself
    without a GGUF quantisation suffix (``SmolLM2-135M-Instruct`` for ``SmolLM2-135M-Instruct.Q4_1``)."""
    return frozenset({model_name, _QUANT_SUFFIX.sub("", model_name)})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str = "kvstrata"
    """The id ``/v1/models`` lists; requests naming another model are refused. Requests may also
    name it without its quantisation suffix, or with an organisation prefix (``org/name``), as
    OpenAI-style clients and Hugging Face ids do (:meth:`serves`)."""
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 4096
    """The most ``max_tokens`` a request may ask for."""
    default_max_tokens: int = 256
    create_sessions: bool = True
    """A request naming a session that does not exist creates it; with False it gets a 404 and
    sessions are made with ``POST /v1/sessions``."""
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    audit_path: Path | None = None
    max_archive_bytes: int = 1 << 30
    response_ttl_s: float = 30 * 86400.0
    """How long the session of a stored response (``POST /v1/responses`` with ``store``) is kept
    after its last use, unless the request named a session of its own (OpenAI keeps stored
    responses 30 days)."""
    session_ttl_s: float | None = None
    """The TTL of a session a request creates when it sends no ``X-Session-TTL`` (None: none; gc
    then keeps it for ``GcConfig.retention_s``)."""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.max_tokens_limit < 1:
            raise ConfigError("max_prompt_tokens and max_tokens_limit must be >= 1")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("default_max_tokens must be in 1..max_tokens_limit")
        if not self.response_ttl_s > 0:
            raise ConfigError("response_ttl_s must be > 0")
        if self.session_ttl_s is not None and not (
            math.isfinite(self.session_ttl_s) and self.session_ttl_s > 0
        ):
            raise ConfigError("session_ttl_s must be a positive number of seconds")

    def serves(self, requested: str) -> bool:
        """Whether a request's ``model`` names the served model."""
        return requested.rsplit("/", 1)[-1] in model_names(self.model_name)


@dataclass(slots=True)
class ServerContext:
    engine: Engine
    config: ServerConfig
    audit: AuditLog | None
    metrics: ServerMetrics

    @property
    def store(self) -> KVStore:
        return self.engine.store

    @property
    def store_lock(self) -> threading.RLock:
        """Held by whatever uses the store's sessions beside the engine's own store worker (an
        admin action, the check of a request's session): they run in worker threads, off the
        event loop. Generation requests do not hold it: they run together in the engine's batch."""
        return self.engine.store_lock
