"""The Prefect flows (evaluate, drift, labels): thin bodies that list their steps; tasks do the work."""
