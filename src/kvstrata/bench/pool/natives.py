"""The native helpers encoded device memory runs on, loaded before anything is timed.

Each is built (or loaded from the machine's cache) in a background thread on first use, and the
torch path serves until it is loaded: in a short run the first requests over encoded blocks
(pages dequantized for a prefill, int8 decoded, records checksummed) would be timed on the slow
path. The pool, agents and trace suites wait for them first and say what they got.
"""

from __future__ import annotations

TIMEOUT_S = 600.0


def load_natives(timeout_s: float = TIMEOUT_S) -> dict[str, str]:
    """Load the decode kernel, the pages' dequantization, the int8 decode and encode and the CRC32C helpers,
    waiting at most ``timeout_s`` for each; their status by name (``loaded``, or why not)."""
    from kvstrata.codecs import _native, _pages_native, _quant_native
    from kvstrata.engine.batch import decode_kernel
    from kvstrata.store import _native_crc

    decode_kernel.load(timeout=timeout_s)
    status = {"decode kernel": decode_kernel.status()}
    for name, library in (
        ("pages dequantization", _pages_native.LIBRARY),
        ("int8 decode", _native.LIBRARY),
        ("int8 encode", _quant_native.LIBRARY),
        ("crc32c", _native_crc.LIBRARY),
    ):
        library.load(timeout_s)
        status[name] = library.status()
    return status
