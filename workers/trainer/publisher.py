"""Publishing weight versions without stopping training.

After a step the trainer copies its parameters into a CPU shadow of the model
(loaded once from the run's model folder, so the published config.json is the
source's, untouched by training settings such as use_cache) and a background
thread writes the version folder: save, fsync, rename, LATEST, prune. On the
tiny model that is about 0.1 s a version, mostly fsync, which the next step
overlaps. One publication at a time: the next one first waits for the last.
An error in the thread is raised by the next call.

Under FSDP (`gathered`) the caller hands over a freshly gathered full state
dict (fsdp.full_state_dict): the shadow takes its tensors without copying
(assign) and lets go of them once the folder is written, so rank 0 holds one
full copy of the weights, and only while a version is being published.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from buffer.layout import StorageError
from workers.trainer.background import Background
from workers.weights import WeightStore


class Publisher:
    """Publishes versions of `model` to `store`, in a background thread if `background`."""

    def __init__(self, store: WeightStore, model_folder: Path, tokenizer, *, keep: int, background: bool,
                 gathered: bool = False) -> None:
        from workers.model import load_model

        self.store, self.tokenizer, self.keep, self.background = store, tokenizer, keep, background
        self.gathered = gathered
        self.shadow = load_model(model_folder, dtype="float32", device="cpu")
        if gathered:
            self.shadow.to("meta")   # holds no weights between publications
        self._job = Background()
        self.last_seconds = 0.0   # how long the last publication took, start to LATEST

    def publish(self, state: dict[str, torch.Tensor], version: int, info: dict | None = None, *,
                wait: bool = False) -> float:
        """Start publishing `version` from `state` (the model's state_dict); returns seconds the caller spent.

        Not gathered: `state` may be the live parameters (they are copied before this returns).
        wait=True (or background off): return only when the folder and LATEST are on disk.
        """
        t0 = time.perf_counter()
        self.wait()
        with torch.no_grad():
            self.shadow.load_state_dict(state, assign=self.gathered)
        if self.gathered and getattr(self.shadow.config, "tie_word_embeddings", False):
            self.shadow.tie_weights()   # assign replaced the tied tensor by two equal ones
        job = lambda: self._run(version, info)  # noqa: E731
        if self.background and not wait:
            self._job.start(job, f"publish-v{version}")
        else:
            self._job.run(job)
            self.wait()
        return time.perf_counter() - t0

    def _run(self, version: int, info: dict | None) -> None:
        t0 = time.perf_counter()
        try:
            self.store.publish(self.shadow, self.tokenizer, version, info=info)
            self.store.prune(self.keep)
            if self.gathered:
                self.shadow.to("meta")
        finally:
            self.last_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Until the publication in flight is done; raises its error, if any."""
        error = self._job.join()
        if error is not None:
            if isinstance(error, StorageError):
                raise error  # already names the folder and what to do; LATEST is unchanged
            raise RuntimeError(f"publishing weights to {self.store.root} failed: {error}") from error
