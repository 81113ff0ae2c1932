"""Ports for test processes to bind later: launcher.ports' picker (below the ephemeral range, checked, never
handed out twice by one process), shared with the served benchmarks and `tandem serve`'s helpers."""

from launcher.ports import free_base_port, free_port

__all__ = ["free_base_port", "free_port"]
