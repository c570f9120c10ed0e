"""What operators watch: the queue's state as Prometheus metrics, read from Redis and the DB."""
