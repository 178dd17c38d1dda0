"""The command line: one module per command group (each adds its commands with ``add_parser``); ``main``
assembles them and maps errors to exit codes."""
