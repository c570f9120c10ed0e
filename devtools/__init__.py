"""Development tooling, not part of the product: the demo, its embedded Redis, the tiny model."""
