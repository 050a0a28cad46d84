"""The ``mixfleet`` command: :mod:`mixfleet.cli` dispatches to each package's subcommand module.

It sits above every package (formats, weight_sync, fleet, router) and may import any of them;
none of them imports it. ``python -m mixfleet`` runs the same command.
"""
