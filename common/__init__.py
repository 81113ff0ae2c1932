"""Torch-free pieces shared by every process: the typed error taxonomy, the typed msgpack codec, a
worker's network thread and its HTTP health server."""
