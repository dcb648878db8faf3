"""The trainer CLI, except that it stops dead in the middle of step PAUSE_STEP, for kill -9 tests:
trainer_pause.py PAUSE_STEP MARKER TRAINER_ARGS...

"Middle": at the second forward pass of that step, so its pull is in the ledger and its first
micro-batch's backward ran, but the step is not finished. There the process writes MARKER and
sleeps until killed (conftest.kill_9_at_pause). The pause is patched in here, in the test's
process only, as in fsdp_kill.py.
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")   # as trainer_fixtures.env(): one OpenMP thread, set before torch loads

import workers.trainer.loop as loop  # noqa: E402
from workers.trainer.main import main  # noqa: E402

pause_step, marker = int(sys.argv[1]), Path(sys.argv[2])
_train_step = loop.train_step


def _train_step_then_pause(model, *args, step: int, **kwargs):
    if step == pause_step:
        calls = []

        def pause_on_second_forward(module, inputs):
            calls.append(1)
            if len(calls) == 2:
                marker.write_text(str(os.getpid()))
                while True:
                    time.sleep(1)

        model.register_forward_pre_hook(pause_on_second_forward)
    return _train_step(model, *args, step=step, **kwargs)


loop.train_step = _train_step_then_pause

if __name__ == "__main__":
    sys.exit(main(sys.argv[3:]))
