"""``kvstrata serve --ssl-certfile/--ssl-keyfile``: the real command serves HTTPS with a
self-signed certificate (made here with ``cryptography``) to the official ``openai`` client; a
certificate that does not load, or half a pair, is one line before the model loads."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from server_builders import free_port
from typer.testing import CliRunner

from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import save_tiny_llama

KEY = "tls-key"


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key; (cert, key) PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstrata test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def trust(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``kvstrata serve`` over TLS on the tiny model; (base URL, the certificate to trust)."""
    root = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(root)
    model = save_tiny_llama(root / "model", seed=0)
    port = free_port()
    env = {**os.environ, "KVSTRATA_MODEL_CACHE": str(root / "cache"), "KVSTRATA_API_KEYS": f"{KEY}:team"}
    command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(model)]
    command += ["--store", str(root / "store"), "--port", str(port)]
    command += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    log = root / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", verify=trust(cert), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url, cert
    finally:
        process.terminate()
        process.wait(30)


def test_the_openai_client_talks_to_the_server_over_tls(https_server: tuple[str, Path]) -> None:
    url, cert = https_server
    with httpx.Client(verify=trust(cert)) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=http, max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "hello over TLS"}],
            max_tokens=4,
            extra_headers={"X-Session-Id": "tls"},
        )
        assert reply.choices[0].message.content is not None
        again = client.chat.completions.create(
            model=reply.model,
            messages=[{"role": "user", "content": "hello over TLS"}],
            max_tokens=4,
        )
        assert again.usage is not None and again.usage.prompt_tokens == reply.usage.prompt_tokens  # type: ignore[union-attr]
    # the certificate is what makes it trusted, and plain HTTP gets no answer
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5)  # the system's CAs do not know it
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://") + "/healthz", timeout=5)


def test_a_certificate_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    runner = CliRunner()
    store = ["--store", str(tmp_path / "store")]
    cases = {
        "cannot load the TLS certificate": ["--ssl-certfile", str(garbage), "--ssl-keyfile", str(key)],
        "missing.pem": ["--ssl-certfile", str(tmp_path / "missing.pem"), "--ssl-keyfile", str(key)],
        "needs both --ssl-certfile and --ssl-keyfile": ["--ssl-certfile", str(cert)],
        "KEY_VALUES_MISMATCH": ["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
    }
    for expected, args in cases.items():
        result = runner.invoke(app, ["serve", *store, *args])
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.output
