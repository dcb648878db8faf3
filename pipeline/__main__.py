"""`python -m pipeline`: the asyncgrpo command (what every daemon runs, and torchrun runs per trainer rank)."""

from pipeline.children import die_with_parent_if_asked
from pipeline.cli import main

die_with_parent_if_asked()
main()
