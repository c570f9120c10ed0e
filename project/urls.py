"""Top-level URLs: the admin and its queue dashboard, the bulk job pages, the OpenAI-compatible
API, /metrics and /health."""

from django.contrib import admin
from django.urls import include, path

from llmqueue.api.health import health
from llmqueue.api.metrics import metrics
from llmqueue.dashboard_view import queue_dashboard

urlpatterns = [
    path(
        "admin/queue-dashboard/",
        admin.site.admin_view(queue_dashboard),  # staff only, like every admin page
        name="llmqueue-dashboard",
    ),
    path("admin/", admin.site.urls),
    path("bulk/", include("llmqueue.bulk_pages.urls")),
    path("v1/", include("llmqueue.api.urls")),
    path("metrics", metrics, name="metrics"),
    path("health", health, name="health"),
]
# Errors raised before a view runs: JSON under /v1/ (llmqueue/api/handlers.py).
handler400 = "llmqueue.api.handlers.bad_request"
handler404 = "llmqueue.api.handlers.not_found"
handler500 = "llmqueue.api.handlers.server_error"
