"""Oracle label requests: triggers, allocation, budgets, manifests."""
