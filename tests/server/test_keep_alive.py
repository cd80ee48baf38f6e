"""An idle client connection outlives the pause of an agent between two turns.

Clients keep an idle connection for a while and send the next request on it (httpx and the openai
client for 5 s, aiohttp 15). uvicorn's default closes it after 5 s, so a request sent as the server
closes is lost (the 2-hour soak of 2026-12-06 saw a streamed turn fail with ``ReadError``);
``kvstrata serve`` keeps idle connections ``--keep-alive`` seconds (75 by default)."""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from server_builders import server_process

from kvstrata.cli.serve_cmd import KEEP_ALIVE_S
from kvstrata.integrations.transformers.model import save_tiny_llama

IDLE_S = 6.0  # an agent's pause between turns: past uvicorn's default of 5 s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "model", seed=0)


def test_a_connection_idle_between_turns_is_still_open(model_dir: Path, tmp_path: Path) -> None:
    assert KEEP_ALIVE_S > 15  # longer than the clients' own idle limits
    with server_process(model_dir, tmp_path / "store", model_cache=tmp_path / "cache") as server:
        url = urlsplit(server.url)
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        try:
            ends = []
            for turn in range(2):
                connection.request("GET", "/healthz")
                response = connection.getresponse()  # RemoteDisconnected if the server closed it
                assert response.status == 200 and response.read()
                assert response.getheader("connection", "keep-alive").lower() != "close"
                ends.append(connection.sock.getsockname())
                if turn == 0:
                    time.sleep(IDLE_S)
            assert ends[0] == ends[1]  # the same connection, not a new one
        finally:
            connection.close()
    # the start says what it does before uvicorn's first line (a start can take minutes under load)
    log = server.log_path.read_text()
    lines = [
        log.index(line)
        for line in ("kvstrata serve: loading the model", "loaded in", "ready after", "Uvicorn")
    ]
    assert lines == sorted(lines), log


def test_the_keep_alive_is_given_to_uvicorn(model_dir: Path, tmp_path: Path) -> None:
    """``--keep-alive 1``: the server closes an idle connection after a second."""
    with server_process(
        model_dir, tmp_path / "store", model_cache=tmp_path / "cache", extra_args=("--keep-alive", "1")
    ) as server:
        url = urlsplit(server.url)
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        try:
            connection.request("GET", "/healthz")
            response = connection.getresponse()
            assert response.status == 200 and response.read()
            time.sleep(5)  # the server closes it after 1 s, given a loaded machine 4 more
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                connection.request("GET", "/healthz")
                connection.getresponse()
        finally:
            connection.close()
