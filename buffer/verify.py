"""Full verification of a buffer's shards: every page read and its checksum checked.

Footer damage (a truncated or overwritten file) shows up on any read; damage
inside a data page only when that page is decoded. The sampler checks pages it
pulls; `verify` checks all of them, for a buffer that was copied, restored or
kept on doubtful storage.
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from buffer.layout import BufferDir


def verify(root: str | os.PathLike, *, quarantine: bool = True) -> dict[str, str]:
    """Read every live shard and ledger shard in full; return {file name: reason} of the bad ones.

    Bad rollout shards are quarantined when `quarantine` is set; ledger shards
    are only reported (the ledger is the trainer's, and losing a record would
    let a group be trained twice).
    """
    d = BufferDir(root)
    bad: dict[str, str] = {}
    for p in d.live_shards() + d.ledger_shards():
        try:
            pq.read_table(p, page_checksum_verification=True)
        except FileNotFoundError:
            continue  # compacted away meanwhile
        except Exception as e:  # noqa: BLE001 - any decode failure
            reason = f"failed verification: {type(e).__name__}: {e}"
            bad[p.name] = reason
            if quarantine and p.parent == d.shards:
                d.quarantine(p, reason)
    return bad
