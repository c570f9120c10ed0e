"""The Celery app: configured from Django settings (CELERY_*).

Both programs use it: the API to publish (by task name: it never loads the worker's task) and to
read results, the GPU worker to consume (workers/serve.py imports its task, workers/tasks.py)."""

import os

from celery import Celery

from celery_ext import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
broker.install()  # kombu's Redis transport, minus a client per command (celery_ext/broker.py)

app = Celery("llmqueue")
app.config_from_object("django.conf:settings", namespace="CELERY")
