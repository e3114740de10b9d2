"""`python -m tierstore.cli`: the `tierstore` command."""

from tierstore.cli import main

main()
