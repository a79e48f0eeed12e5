"""The `quantgate` command line: one thin module per command group over the capability packages."""
