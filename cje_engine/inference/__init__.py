"""Inference shared by every mode: multiplicity adjustment (and, later, clustered variance, comparisons)."""
