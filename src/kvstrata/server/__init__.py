"""The HTTP service: an OpenAI-compatible API over one engine, plus session admin and metrics."""

from kvstrata.server.app import create_app
from kvstrata.server.context import ServerConfig

__all__ = ["ServerConfig", "create_app"]
