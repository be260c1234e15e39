"""`python -m specrt.cli`: the specrt command."""

from specrt.cli import main

main()
