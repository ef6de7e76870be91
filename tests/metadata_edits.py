"""Hand edits of a saved checkpoint's metadata files, for tests of what loads check.

Every metadata file is covered by the checksums recorded at commit
(``_CHECKSUMS``), which catch any edit first. A test of what is checked
beyond them either makes the checkpoint look written before those checksums
(or by Orbax), or records them again after its edit, as someone editing the
files on purpose could.
"""

from __future__ import annotations

import checkpointables as cp


def without_metadata_checksums(checkpoint) -> None:
    """Makes ``checkpoint`` look written by Orbax, or before metadata checksums existed: no
    ``_CHECKSUMS``, and a commit marker that does not say there was one."""
    (checkpoint / cp.metadata_checksums.CHECKSUMS_FILE).unlink()
    marker = checkpoint / cp.layout.COMMIT_SUCCESS_FILE
    lines = marker.read_text().splitlines(keepends=True)
    marker.write_text("".join(x for x in lines if x.strip() != cp.metadata_checksums.RECORDED_MARK))


def with_metadata_checksums_recomputed(checkpoint) -> None:
    """Records ``checkpoint``'s metadata checksums again, after an edit."""
    cp.metadata_checksums.record(checkpoint)
