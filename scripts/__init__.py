"""Helper scripts (importable so tests can reuse them, e.g. ``scripts.make_tiny_checkpoints``)."""
