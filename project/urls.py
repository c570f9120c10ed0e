"""Top-level URLs: the admin, the OpenAI-compatible API and Prometheus' /metrics."""

from django.contrib import admin
from django.urls import include, path

from llmqueue.api.metrics import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/", include("llmqueue.api.urls")),
    path("metrics", metrics, name="metrics"),
]
