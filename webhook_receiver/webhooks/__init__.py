"""Provider webhooks: verified, deduplicated receipt at /webhooks/<source>."""
