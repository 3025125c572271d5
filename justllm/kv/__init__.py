"""KV accounting: the block pool (and, later, the radix prefix cache)."""
