"""A writer process for concurrency and kill -9 tests.

usage: writer_proc.py BUFFER NAME GROUPS FLUSH_GROUPS LOG
Appends GROUPS groups of 8 completions; once a shard is renamed into place
(the writer's flush threads write in the background), appends its group ids
to LOG, so LOG only ever lists flushed groups.
"""

import os
import sys

import numpy as np

from buffer import Completion, Group, ShardWriter

root, name, groups, flush_groups, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = np.random.default_rng(abs(hash(name)) % 2**32)
w = ShardWriter(root, generator_id=name, flush_groups=flush_groups, flush_seconds=None)
ids, logged = [], 0
with open(log, "a") as f:
    for i in range(groups):
        comps = [Completion(text="x", token_ids=rng.integers(0, 64, 64), logprobs=-rng.random(64),
                            reward=float(j % 2)) for j in range(8)]
        ids.append(w.append(Group(prompt_id=f"{name}-{i}", prompt="p", prompt_ids=[1],
                                  version=0, completions=comps)))
        visible = len(ids) - w.pending_groups  # shards become visible in order: the first ones
        if visible > logged:
            f.write("".join(g + "\n" for g in ids[logged:visible]))
            f.flush()
            os.fsync(f.fileno())
            logged = visible
    w.close()
    f.write("".join(g + "\n" for g in ids[logged:]))
print("done", flush=True)
