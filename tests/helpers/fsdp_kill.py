"""The trainer CLI, except that rank KILL_RANK kills itself (SIGKILL) in the middle of step KILL_STEP.

"Middle": at the second forward pass of that step, after its first micro-batch's backward
(and its reduce-scatter) ran on every rank. Run under torchrun like workers.trainer.main.
"""

import os
import signal
import sys

import workers.trainer.loop as loop
from workers.trainer.main import main

_train_step = loop.train_step


def _train_step_then_die(model, *args, step: int, **kwargs):
    if int(os.environ["RANK"]) == int(os.environ["KILL_RANK"]) and step == int(os.environ["KILL_STEP"]):
        calls = []

        def die_on_second_forward(module, inputs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        model.register_forward_pre_hook(die_on_second_forward)
    return _train_step(model, *args, step=step, **kwargs)


loop.train_step = _train_step_then_die

if __name__ == "__main__":
    sys.exit(main())
