"""Deployment files, imported by nothing of the product: the install script, the broker pin, the Dockerfile, the
OpenTelemetry Collector, Prometheus and Grafana files, and a standalone reader of the wire format
(``wire_reader.py``).
"""
