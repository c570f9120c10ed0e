"""llmqueue's extensions of Celery and kombu, each an override justified by a measurement.

Checked against kombu 5.7.0 and Celery 5.7.0 (pinned in requirements.txt); tests/test_broker.py
checks each against the library's own behaviour, so an upgrade that moves them fails a test.

- broker.py: kombu's Redis transport with one client per channel (kombu built a `redis.Redis` per
  command: ~0.1 ms of GIL each, three per request on the worker's event loop), the unacked
  bookkeeping without MULTI/EXEC, a per-BRPOP timeout, and a delivery hook that lets the worker
  count and start a request before Celery handles its message; with a `sentinel://` URL the same
  channel on kombu's Redis Sentinel pools.
- rescue.py: a dead worker's held messages (broker.py records whose each delivered message is)
  restored through kombu's `restore_by_tag` as soon as its beat goes stale, and a live worker's
  held messages dated anew in kombu's unacked index with every beat: a SIGKILLed worker's
  requests came back after the visibility timeout (an hour in production) before.
- queue_cycle.py: kombu's queue-order strategy hook (`TierCycle`), so a worker's dispatch policy
  orders each BRPOP over its tier queues while every other process keeps kombu's round robin.
- message.py: the task message built by hand instead of `apply_async` (0.8 ms of CPU per call,
  1.7 ms of the API's 6.6 ms per request under load).
- result_backend.py: Celery's Redis result backend without its read-before-write (one round trip
  per stored state instead of two; only the claim holder publishes an outcome anyway), and its
  variant on Celery's sentinel backend.

Nothing here imports the API (llmqueue) or the worker (workers): both use these.
"""
