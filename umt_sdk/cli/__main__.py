"""`python -m umt_sdk.cli`: the `umt` command line."""

from umt_sdk.cli import main

main()
