"""Torch-free pieces shared by every process: the typed error taxonomy."""
