"""Launching pdserve: configuration, Ray placement, health, and the ``pdserve`` command."""
