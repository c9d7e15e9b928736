"""The ``cachefs`` command."""
