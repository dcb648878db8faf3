"""The replay buffer: Parquet shards on disk, a consumption ledger, and SQL views.

Never imports torch (nor workers/ or pipeline/): generators, the trainer and
the CLI all come here through files.
"""

from buffer.compaction import CompactionReport, compact
from buffer.index import STATE_NAMES, GroupIndex, admission_limit
from buffer.layout import BufferDir, BufferError, StorageError, find_buffer
from buffer.sampler import ORDERS, Batch, Sampler
from buffer.schema import LEDGER_SCHEMA, ROLLOUT_COLUMN_DOCS, ROLLOUT_SCHEMA, staleness
from buffer.sql import BufferSQL, SqlError, check_read_only
from buffer.writer import Completion, Group, ShardWriter, filter_reason, group_reward_stats

__all__ = [
    "Batch", "BufferDir", "BufferError", "BufferSQL", "CompactionReport", "Completion", "Group",
    "GroupIndex", "LEDGER_SCHEMA", "ORDERS", "ROLLOUT_COLUMN_DOCS", "ROLLOUT_SCHEMA", "STATE_NAMES",
    "Sampler", "ShardWriter", "SqlError", "StorageError", "admission_limit", "check_read_only", "compact",
    "filter_reason", "find_buffer", "group_reward_stats", "staleness",
]
