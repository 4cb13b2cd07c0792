"""Every ``kvrelay`` command's argument parsing; each module exposes ``add_arguments(parser)`` and
``run(args) -> int``. Nothing imports this package but ``kvrelay.cli.main``."""
