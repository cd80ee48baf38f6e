from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata import CorruptBlockError, KVLayout, LayoutMismatchError
from kvstrata.cli.main import app
from kvstrata.codecs import EncodedBlock
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, decode_record, encode_record

from conftest import make_block

runner = CliRunner()


def _record(layout: KVLayout, seed: int = 1) -> tuple[bytes, EncodedBlock, bytes]:
    block = make_block(layout, seed)
    encoded = block.encode()
    return encode_record(block.key, encoded, layout.fingerprint, start_pos=8), encoded, block.key


def test_round_trip(layout: KVLayout) -> None:
    data, encoded, key = _record(layout)
    assert len(data) == HEADER_BYTES + len(encoded.payload) + TRAILER_BYTES
    header, decoded = decode_record(data, expected_key=key, expected_layout=layout.fingerprint)
    assert decoded == encoded
    assert (header.key, header.num_tokens, header.start_pos) == (key, layout.block_tokens, 8)


def test_wrong_key_and_layout_are_rejected(layout: KVLayout) -> None:
    data, _, _ = _record(layout)
    with pytest.raises(CorruptBlockError, match="expected"):
        decode_record(data, expected_key=bytes(32))
    with pytest.raises(LayoutMismatchError):
        decode_record(data, expected_layout=bytes(16))


def _mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    cases = []
    regions = {
        "header": (0, HEADER_BYTES),
        "payload": (HEADER_BYTES, len(data) - TRAILER_BYTES),
        "trailer": (len(data) - TRAILER_BYTES, len(data)),
    }
    for region, (lo, hi) in regions.items():
        for _ in range(140):
            pos = rng.randrange(lo, hi)
            flipped = bytearray(data)
            flipped[pos] ^= 1 << rng.randrange(8)
            cases.append((f"bit flip in {region} at {pos}", bytes(flipped)))
    for _ in range(80):
        cut = rng.randrange(0, len(data))
        cases.append((f"truncated to {cut}", data[:cut]))
    cases.append(("trailing garbage", data + b"\0"))
    return cases


def test_every_corruption_is_detected_and_inspect_exits_1(layout: KVLayout, tmp_path: Path) -> None:
    """Acceptance 3: >= 500 seeded corruptions; each raises, none returns data, inspect exits 1."""
    data, _, key = _record(layout)
    cases = _mutations(data, random.Random(20261129))
    assert len(cases) >= 500
    path = tmp_path / "block.kvbin"
    for what, corrupted in cases:
        with pytest.raises(CorruptBlockError):
            decode_record(corrupted, path=path, expected_key=key, expected_layout=layout.fingerprint)
        path.write_bytes(corrupted)
        result = runner.invoke(app, ["inspect", str(path)])
        assert result.exit_code == 1, what
        assert "corrupt" in result.output and str(path) in result.output.replace("\n", ""), what


def test_inspect_prints_header(layout: KVLayout, tmp_path: Path) -> None:
    data, _, key = _record(layout)
    path = tmp_path / "ok.kvbin"
    path.write_bytes(data)
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert key.hex() in result.output and '"crc32c": "ok"' in result.output
