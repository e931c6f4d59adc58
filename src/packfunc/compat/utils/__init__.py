"""Helpers shared by the BackPACK-compatible shim (BackPACK's ``utils``)."""
