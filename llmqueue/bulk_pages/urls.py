"""URLs of the /bulk/ pages, their login and logout included."""

from django.contrib.auth import views as auth_views
from django.urls import path

from llmqueue.bulk_pages import views

urlpatterns = [
    path("", views.job_list, name="bulk-jobs"),
    path("new/", views.upload, name="bulk-upload"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="llmqueue/bulk/login.html", extra_context={"title": "Log in"}
        ),
        name="bulk-login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="bulk-logout"),
    path("<str:job_id>/", views.job_detail, name="bulk-job"),
    path("<str:job_id>/progress.json", views.job_progress_json, name="bulk-job-progress"),
    path("<str:job_id>/cancel/", views.job_cancel, name="bulk-job-cancel"),
    path("<str:job_id>/results.jsonl", views.job_results, name="bulk-job-results"),
]
