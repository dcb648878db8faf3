"""A querying reader for concurrency tests: usage reader_proc.py BUFFER STOP_FILE MIN_QUERIES [SECONDS].

Prints "ready", then queries row and group counts in a loop until STOP_FILE exists and it
made at least MIN_QUERIES queries (or SECONDS pass, 240 by default: the test then sees too
few); prints one JSON line with the number of queries, errors and 'wrong' results (rows
not 8 x groups, or counts going down).
"""

import json
import sys
import time
from pathlib import Path

from buffer import BufferSQL

root, stop_file, min_queries = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 240.0
db = BufferSQL(root, quarantine=False)
queries = errors = wrong = 0
last = 0
messages = []
print("ready", flush=True)
end = time.time() + seconds
while not (stop_file.exists() and queries >= min_queries) and time.time() < end:
    try:
        (r,) = db.query("SELECT count(*) AS rows, count(DISTINCT group_id) AS groups FROM rollouts").to_pylist()
        queries += 1
        if r["rows"] != 8 * r["groups"] or r["groups"] < last:
            wrong += 1
            messages.append(str(r))
        last = r["groups"]
    except Exception as e:  # noqa: BLE001 - counted, that is the point
        errors += 1
        messages.append(repr(e)[:200])
print(json.dumps({"queries": queries, "errors": errors, "wrong": wrong, "last": last, "messages": messages[:5]}))
