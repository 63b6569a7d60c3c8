"""`python -m esk`: the `esk` command, for child processes that must use this interpreter."""

from .cli import main

main()
