"""Small native (C) helpers, compiled on first use and cached per machine.

kvstrata is pure Python; a few loops run at memory speed only in compiled code. Each helper is
a C source shipped in the package, compiled by the machine's C compiler into a shared library
the first time a process wants it (in a background thread: the caller keeps its pure-torch path
until the library is loaded), cached under ``platformdirs.user_cache_dir("kvstrata")/native``
(``KVSTRATA_NATIVE_CACHE`` overrides it) by a hash of the source, the flags and the compiler, and
called through :mod:`ctypes` (which releases the GIL for the call). Without a compiler, on a CPU
without the instructions a helper needs, or with ``KVSTRATA_NATIVE_KERNELS=0``, the pure-torch
path stays, and the helper's ``status()`` says why.

The batched decode-attention kernel (:mod:`kvstrata.engine.batch.decode_kernel`) is a torch C++
extension instead (it takes lists of tensors, which ``ctypes`` does not), built in the background
the same way (:class:`BackgroundBuild`).
"""

from kvstrata.native.library import ENV, BackgroundBuild, NativeLibrary

__all__ = ["ENV", "BackgroundBuild", "NativeLibrary"]
