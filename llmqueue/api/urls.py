"""URLs of the OpenAI-compatible API under /v1/."""

from django.urls import path

from llmqueue.api import views

urlpatterns = [
    path("completions", views.completions, name="completions"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("models", views.models, name="models"),
    path("requests/<str:request_id>", views.request_status, name="request-status"),
    path("requests/<str:request_id>/cancel", views.cancel_request, name="request-cancel"),
]
