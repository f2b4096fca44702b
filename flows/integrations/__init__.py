"""External systems: webhook/event notifications, an OpenAI-compatible judge scorer."""
