"""Prefect flows, storage, publishing, reports and the command line around the CJE engine."""
