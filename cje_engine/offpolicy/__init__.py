"""Logs-only and hybrid modes: importance weights, SIMCal, IPS/SNIPS/DR, overlap diagnostics and gates."""
