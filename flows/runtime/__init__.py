"""Where flows run: the embedded Prefect server, Ray fan-out, schedules and deployments."""
