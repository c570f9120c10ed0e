"""The Celery app: configured from Django settings (CELERY_*), tasks autodiscovered."""

import os

from celery import Celery

from llmqueue import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
broker.install()  # kombu's Redis transport, minus a client per command (llmqueue/broker.py)

app = Celery("llmqueue")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
