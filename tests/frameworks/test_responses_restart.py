"""A stored response is continued by ``previous_response_id`` after ``kvstrata serve`` restarted:
the request sends only its new input, and the history's KV comes back from the store (issue 31,
acceptance 1: at least 90% of the prompt cached)."""

from __future__ import annotations

import pytest
from smol_server import server_process, smol_model

pytestmark = pytest.mark.slow

# an agent's system prompt, as long as a real one's (the new input is then a small part of a turn)
INSTRUCTIONS = (
    "You are a travel planner for a small agency. Clients ask about cities in Europe: what to see, "
    "where to eat, how to get around, and how to fit it all into the time they have. Answer in one "
    "short sentence. Name concrete places (a museum, a street, a market) rather than general advice. "
    "Prefer walking and public transport. Mention opening hours only when you are sure of them. If "
    "a request is unclear, make a reasonable assumption and say which one you made. Never invent "
    "prices. Keep a friendly, practical tone, and remember what the client told you earlier in the "
    "conversation: their dates, their budget, who travels with them and what they did already."
)


def test_a_stored_response_is_continued_after_a_restart(tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir, cache = smol_model()
    store = tmp_path_factory.mktemp("responses-restart") / "store"

    with server_process(model_dir, store, model_cache=cache) as server:
        client = server.client(timeout=600)  # a loaded machine decodes slowly
        model = server.model_id()
        first = client.responses.create(
            model=model, instructions=INSTRUCTIONS, input="Plan a day in Paris.", max_output_tokens=48
        )
        second = client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            input="And the evening?",
            previous_response_id=first.id,
            max_output_tokens=48,
        )
        server.stop()  # SIGTERM: a graceful stop (uvicorn exits by the signal)

    with server_process(model_dir, store, model_cache=cache) as server:
        client = server.client(timeout=600)  # a loaded machine decodes slowly
        assert client.responses.retrieve(second.id).output_text == second.output_text
        third = client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            input="And the next morning?",
            previous_response_id=second.id,
            max_output_tokens=8,
        )
        assert third.usage is not None and second.usage is not None
        # the prompt is the whole chain: the first two turns, their answers, the new question
        assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
        assert third.usage.input_tokens_details.cached_tokens >= 0.9 * third.usage.input_tokens
        items = client.responses.input_items.list(third.id, order="asc")
        assert [i.type for i in items.data] == ["message"] * 5
        server.stop()
