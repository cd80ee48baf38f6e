"""Rebuilding the index from the data files, and checking one against the other.

The SQLite index is the one truth while it is there; this package makes it replaceable. Every data
file says what the index needs to be rebuilt (:mod:`.records`): a block record carries its key,
codec, token count and position; a segment ends with an info record (the store it belongs to,
each record's namespace); and every committed session row is written beforehand, in its commit
transaction, to the session journal (``journal/``, :mod:`.journal`), sealed with the store's key
when it is encrypted. ``kvstrata fsck`` (:mod:`.fsck`) checks the index against all of that,
``kvstrata fsck --rebuild`` (:mod:`.rebuild`) makes a new index from the files alone, and gc asks
:mod:`.guard` which files an index that may not have seen them could still need.
"""
