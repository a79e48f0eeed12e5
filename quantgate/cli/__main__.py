"""`python -m quantgate.cli ...`: the same as the `quantgate` console script."""

from quantgate.cli.main import main

main()
