"""OpenAI's Responses API, over kvstrata's sessions: a stored response's conversation is a
session, so continuing it by ``previous_response_id`` sends only the new input and reuses the
whole KV, in the same process or after a restart (see :mod:`.records`)."""

from kvstrata.server.responses_api.routes import router

__all__ = ["router"]
