"""What the contract wings share: the common handlers, pb field helpers, KV RPCs, media, struct release checks."""
