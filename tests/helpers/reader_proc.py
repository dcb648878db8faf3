"""A querying reader for concurrency tests: usage reader_proc.py BUFFER SECONDS.

Queries row and group counts in a loop; prints one JSON line with the number
of queries, errors and 'wrong' results (rows not 8 x groups, or counts going down).
"""

import json
import sys
import time

from buffer import BufferSQL

root, seconds = sys.argv[1], float(sys.argv[2])
db = BufferSQL(root, quarantine=False)
queries = errors = wrong = 0
last = 0
messages = []
end = time.time() + seconds
while time.time() < end:
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
