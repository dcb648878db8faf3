"""The trainer daemon: pulls groups from the buffer, takes GRPO steps, publishes versioned weights.

    run_trainer(run_dir, TrainerConfig(...), model_folder=..., resume=False, offline=False)

Modules: config (TrainerConfig), loop (the daemon loop), session (opening and
rolling back a run), step (one step's epochs and micro-batches), batch (buffer
rows -> tensors), control (LR schedule, KL controller), checkpoint, metrics,
distributed (torchrun), main (`python -m workers.trainer.main`).
"""

from workers.trainer.config import TrainerConfig, config_from_dict
from workers.trainer.loop import run_trainer
from workers.trainer.session import TrainerError

__all__ = ["TrainerConfig", "TrainerError", "config_from_dict", "run_trainer"]
