"""Command line of the trainer alone (the pipeline's `asyncgrpo train` is the usual way in).

    python -m workers.trainer.main --run RUN --model-folder MODEL [--resume] [--offline] [--config CFG]
    torchrun --standalone --nproc_per_node 2 -m workers.trainer.main --run-dir RUN --model-folder MODEL \
        --config CFG

CFG: TrainerConfig fields as a JSON object ('{"lr": 1e-4, "loss": {"beta": 0.05}}'), or a
.json / .toml file of them; a file with a [trainer] table (such as <run>/config.toml) uses
that table. Arguments are parsed before torch is imported, so --help is fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from buffer.store import store_path


def _read_config(text: str | None) -> dict:
    if text is None:
        return {}
    if text.lstrip().startswith("{"):
        return json.loads(text)
    path = Path(text)
    if not path.is_file():
        raise SystemExit(f"--config {text!r} is neither a JSON object nor an existing .json/.toml file")
    if path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(path.read_text())
    else:
        data = json.loads(path.read_text())
    return data.get("trainer", data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.trainer.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # --run-dir: under torchrun, whose parser takes "--run" for a prefix of its own --run-path.
    p.add_argument("--run", "--run-dir", dest="run", required=True,
                   help="Run directory (buffer/, weights/, metrics/, checkpoints/).")
    p.add_argument("--model-folder", required=True, help="The run's initial model (HF folder).")
    p.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint.")
    p.add_argument("--offline", action="store_true",
                   help="Train on the buffer as it is; stop when nothing is left.")
    p.add_argument("--config", help="TrainerConfig overrides: a JSON object, or a .json/.toml file.")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from workers.trainer import config_from_dict, run_trainer

    cfg = config_from_dict(_read_config(args.config))
    run_trainer(store_path(args.run), cfg, model_folder=Path(args.model_folder), resume=args.resume,
                offline=args.offline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
