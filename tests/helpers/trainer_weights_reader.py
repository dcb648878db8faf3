"""A weights reader for the publication test: usage trainer_weights_reader.py WEIGHTS_DIR STOP_FILE SECONDS.

Polls LATEST like a generator and checks the folder it names: every expected
file present, config.json parses, the safetensors header and every tensor's
bytes are readable. A folder that vanished in between (pruned) counts as
`gone`, not as bad. Runs until STOP_FILE exists (or SECONDS pass); prints "ready"
at start, "seen V" the first time it read version V whole (so a publisher can pace
itself on the reader), and one JSON line at the end.
"""

import json
import os
import sys
import time
from pathlib import Path

from safetensors import safe_open

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "weights.json",
            "asyncgrpo.json")

root, stop_file, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
seen, bad, gone, reads = set(), 0, 0, 0
messages = []
print("ready", flush=True)
end = time.time() + seconds
while time.time() < end and not stop_file.exists():
    try:
        text = (root / "LATEST").read_text()
    except FileNotFoundError:
        continue
    if not text.strip().isdigit():
        bad += 1
        messages.append(f"LATEST holds {text!r}")
        continue
    version = int(text)
    folder = root / f"v{version:08d}"
    try:
        names = set(os.listdir(folder))
        missing = [n for n in REQUIRED if n not in names]
        if missing:
            raise ValueError(f"missing {missing}")
        meta = json.loads((folder / "weights.json").read_text())
        if meta["version"] != version:
            raise ValueError(f"weights.json says {meta['version']}")
        json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
            for k in f.keys():
                f.get_tensor(k)
        reads += 1
        if version not in seen:
            print(f"seen {version}", flush=True)
        seen.add(version)
    except FileNotFoundError:
        if folder.exists():
            bad += 1
            messages.append(f"v{version}: a file is missing from a folder that exists")
        else:
            gone += 1
    except Exception as e:  # noqa: BLE001 - counted, that is the point
        if folder.exists():
            bad += 1
            messages.append(f"v{version}: {type(e).__name__}: {e}"[:200])
        else:
            gone += 1
print(json.dumps({"reads": reads, "versions_seen": len(seen), "bad": bad, "gone": gone, "messages": messages[:5]}))
