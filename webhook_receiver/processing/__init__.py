"""Processing: per-consumer deliveries of stored events (the inbox and the outbox)."""
