"""The llmqueue Django project: settings, URLs and the Celery app."""

from project.celery import app as celery_app

__all__ = ("celery_app",)
