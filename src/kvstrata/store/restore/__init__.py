"""Restoring a chain of blocks into one buffer: :mod:`.restorer` (the reads) and :mod:`.copies`
(the copies of the blocks memory holds)."""
