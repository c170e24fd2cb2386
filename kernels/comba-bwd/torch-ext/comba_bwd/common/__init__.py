# Generated from common/ by `python -m tools.vendor`.
"""Helpers shared by the tessera kernel packages, written once in the repository's common/ and copied here."""
