"""Direct mode: cross-fitted calibration, plug-in and augmented estimates, replicates, influence terms."""
