"""Per-phase autoscaler for tandem: a pure decision core (core.py) plus connectors that apply it
(kubernetes.py; a Ray connector implements the same Protocol in connector.py). Entry point:
`autoscaler.main.main(argv)`, wired into the CLI as `tandem autoscaler`."""
