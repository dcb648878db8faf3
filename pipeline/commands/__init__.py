"""The `asyncgrpo` commands, grouped by what they work on; `pipeline.cli` lists them all.

    data         sql, status, compact, demo           (a buffer or run directory)
    daemons      run, generate, train, compactor, eval, init-model, warmstart
    experiments  config, ablate
    reuse        export, rescore                      (a run's stored rollouts)
    observe      plot, track                          (charts and trackers of a run)
    options      what the commands share (CONFIG, --set, logging)
"""
