"""Staleness ablations: `asyncgrpo ablate` and the benchmarks built on it.

Modules:
    spec    what an ablation is: cells, parsing of the options, budget and target checks
    cell    running one cell (online or --replay) and keeping its eval snapshots
    report  one cell's row and curve; ablation.csv / curves.csv / ablation.md / ablation.png
    sweep   the driver: every cell in turn, resumable, with progress

Imports go one way: sweep -> cell, report -> spec.
"""

from pipeline.ablate.spec import (IS_MODES, Ablation, Cell, is_mode_value, make_cells, parse_list, parse_sweep,
                                  parse_target, seed_value, staleness_value)
from pipeline.ablate.sweep import run_ablation

__all__ = ["IS_MODES", "Ablation", "Cell", "is_mode_value", "make_cells", "parse_list", "parse_sweep",
           "parse_target", "run_ablation", "seed_value", "staleness_value"]
