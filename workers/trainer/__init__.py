"""The trainer daemon: pulls groups from the buffer, takes GRPO steps, publishes versioned weights.

    run_trainer(run_dir, TrainerConfig(...), model_folder=..., resume=False, offline=False)

Modules: config (TrainerConfig), loop (the daemon loop), session (opening and
rolling back a run), step (one step's epochs and micro-batches), batch (buffer
rows -> tensors), control (LR schedule, KL controller), checkpoint, metrics,
distributed (torchrun), main (`python -m workers.trainer.main`).

Names are imported on first use, so `python -m workers.trainer.main --help`
does not wait for torch.
"""

from importlib import import_module

_WHERE = {"TrainerConfig": "workers.trainer.config", "config_from_dict": "workers.trainer.config",
          "run_trainer": "workers.trainer.loop", "TrainerError": "workers.trainer.session"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'workers.trainer' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
