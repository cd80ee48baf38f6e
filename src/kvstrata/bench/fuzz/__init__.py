"""``kvstrata bench fuzz``: a fuzzer of the store's files (segments, block files, index pages,
session rows) through the public API and the command line; see :mod:`.runner`."""
