"""URLs of the OpenAI-compatible API under /v1/, the Files and Batch APIs included."""

from django.urls import path, re_path

from llmqueue.api import batch_views, views

urlpatterns = [
    path("completions", views.completions, name="completions"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("models", views.models, name="models"),
    path("requests/<str:request_id>", views.request_status, name="request-status"),
    path("requests/<str:request_id>/cancel", views.cancel_request, name="request-cancel"),
    path("files", batch_views.file_list, name="files"),
    path("files/<str:file_id>", batch_views.file_detail, name="file"),
    path("files/<str:file_id>/content", batch_views.file_content, name="file-content"),
    path("batches", batch_views.batch_list, name="batches"),
    path("batches/<str:batch_id>", batch_views.batch_detail, name="batch"),
    path("batches/<str:batch_id>/cancel", batch_views.batch_cancel, name="batch-cancel"),
    path("openapi.json", views.openapi, name="openapi"),
    # Last: any other /v1/ path is a JSON 404, whatever DEBUG and handler404 say.
    re_path(r"^(?P<path>[\s\S]*)$", views.unknown_route, name="unknown-route"),
]
