"""The ``infinity`` command: one module per subcommand, each with ``add_parser(subparsers)`` and ``run(args)``."""
