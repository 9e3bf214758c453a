"""Subcommands of the ``pitools`` command line, one module each."""
