"""Grafana dashboards of a mixfleet, written by :mod:`deploy.grafana.generate`."""
