"""Exporter for optimum-neuronx artifacts."""
