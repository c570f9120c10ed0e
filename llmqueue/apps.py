"""Django app config for llmqueue."""

from django.apps import AppConfig


class LlmqueueConfig(AppConfig):
    name = "llmqueue"
    verbose_name = "LLM queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from llmqueue.invalidation import connect_signals

        connect_signals()
