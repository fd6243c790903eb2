"""``python -m semspec.flows.cli``: the ``semspec`` command run by module name (the reliability tests
start a stage so)."""

from semspec.flows.cli import main

main()
