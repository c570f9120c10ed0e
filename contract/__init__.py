"""What the API and the GPU workers share, importing neither: task, queues, Redis keys, failures.

The two programs (the Django API, `workers.serve`) agree on these and on nothing else:
`contract.task` (the generate task's name and payload), `contract.queues` (a (pool, tier) lane and
its broker queue name), `contract.keys` (the Redis keys both read or write), `contract.liveness`
(workers' beats), `contract.failures` (why a request failed, as stored and as answered) and
`contract.redis_url` (the client of REDIS_URL: one server, or the master a Sentinel group names).
Standard library and redis-py only: no Django, Celery or kombu (the import-linter contracts in
pyproject.toml hold it to that).
"""
