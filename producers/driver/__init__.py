"""The driver role: verifiers environments played by their own agent loop against the gateway (docs/agents.md)."""
