"""Generator timings: one row per batch, so that the generator idle share is a SQL query.

    SELECT generator_id, sum(wait_s) / sum(seconds) AS idle_share
    FROM generator_metrics GROUP BY 1

(`asyncgrpo sql RUN ...`; the view reads `<run>/generator_metrics/*.parquet`.)
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from workers.proc import rss_mb

STATS_DIR = "generator_metrics"


class GeneratorStats:
    """One row per generator batch in `<run>/generator_metrics/<writer_id>-<seq>.parquet`.

    Columns: generator_id, writer_id, batch (0: start-up), version, started_at (unix s),
    wait_s (admission: waiting for the trainer, or in lockstep for the next version;
    batch 0: waiting for v0), reload_s (loading weights), generate_s, score_s (scoring
    and appending), seconds (the whole iteration: wait + reload + generate + score),
    rss_mb (the process's resident memory, workers.proc), prompts, groups, filtered,
    surplus_groups, tokens. Written like every other file:
    temp name, then rename; the writer id (allocated under the buffer's lock) makes
    the names of each generator process its own. Flushed every `flush_seconds` and on close.
    """

    COLUMNS = ("prompts", "groups", "filtered", "surplus_groups", "tokens")

    def __init__(self, run: Path, generator_id: str, writer_id: str, flush_seconds: float):
        self.root = run / STATS_DIR
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.generator_id, self.writer_id, self.flush_seconds = generator_id, writer_id, flush_seconds
        self.rows: list[dict] = []
        self.batches = 0
        self._seq = 0
        self._last_flush = time.time()
        self._rss = (-math.inf, 0.0)   # (monotonic time read, MiB)

    def _rss_mb(self) -> float:
        """rss_mb(), read at most once a second: read on every batch (~90 ms late in a run) it took
        1.8% of the generator's samples under py-spy, for a figure that moves over minutes."""
        now = time.monotonic()
        if now - self._rss[0] >= 1.0:
            self._rss = (now, rss_mb())
        return self._rss[1]

    def add(self, *, batch: int, version: int, started_at: float, wait_s: float = 0.0, reload_s: float = 0.0,
            generate_s: float = 0.0, score_s: float = 0.0, **counts: int) -> None:
        self.batches = max(self.batches, batch)
        self.rows.append({
            "generator_id": self.generator_id, "writer_id": self.writer_id, "batch": batch, "version": version,
            "started_at": started_at, "wait_s": wait_s, "reload_s": reload_s, "generate_s": generate_s,
            "score_s": score_s, "seconds": time.time() - started_at, "rss_mb": self._rss_mb(),
            **{k: int(counts.get(k, 0)) for k in self.COLUMNS}})
        self.flush_if_due()

    def flush_if_due(self) -> None:
        if self.rows and time.time() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from buffer.layout import atomic_file

        self._last_flush = time.time()
        if not self.rows:
            return
        final = self.root / f"{self.writer_id}-{self._seq:06d}.parquet"
        with atomic_file(self.tmp, final) as f:
            pq.write_table(pa.Table.from_pylist(self.rows), f, compression="zstd")
        self._seq += 1
        self.rows = []

    def close(self) -> None:
        self.flush()
