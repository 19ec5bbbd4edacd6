"""`python -m batchlens`: the same CLI as the `batchlens` command."""

from batchlens.cli import main

main()
