"""Top-level URLs: the admin and the OpenAI-compatible API."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/", include("llmqueue.api.urls")),
]
