"""The ``infinity`` command: one module per subcommand, registered in ``infinity.cli.main.COMMANDS``."""
