"""llmqueue's test suite: real Redis, real Celery workers, real vLLM CPU engine."""
