"""The replay buffer: Parquet shards on disk, a consumption ledger, and SQL views.

Never imports torch (nor workers/ or pipeline/): generators, the trainer and
the CLI all come here through files.

Names are imported on first use, so that importing one module (e.g.
`buffer.groups`, which config checks reach through `workers.grpo.options`)
does not load pyarrow and DuckDB.
"""

from importlib import import_module

_WHERE = {
    **dict.fromkeys(["CompactionReport", "compact", "compact_ledger", "compact_small", "merge_levels",
                     "unmerged_count"],
                    "buffer.compaction"),
    **dict.fromkeys(["Completion", "Group", "STD_MODES", "StdMode", "filter_reason", "group_reward_stats"],
                    "buffer.groups"),
    **dict.fromkeys(["STATE_NAMES", "GroupIndex", "admission_limit", "group_states", "reason_codes", "state_counts"],
                    "buffer.index"),
    **dict.fromkeys(["BufferDir", "BufferError", "StorageError", "find_buffer"], "buffer.layout"),
    **dict.fromkeys(["ORDERS", "Batch", "Sampler"], "buffer.sampler"),
    **dict.fromkeys(["FILTER_REASONS", "LEDGER_SCHEMA", "ROLLOUT_COLUMN_DOCS", "ROLLOUT_SCHEMA", "staleness"], "buffer.schema"),
    **dict.fromkeys(["BufferSQL", "SqlError", "check_read_only", "offline_connection"], "buffer.sql"),
    "ShardWriter": "buffer.writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'buffer' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
