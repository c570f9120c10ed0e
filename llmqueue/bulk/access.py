"""Who sees which bulk jobs on the /bulk/ pages.

Staff see every tenant's; any other user the jobs of the tenants they are members of
(Tenant.members, edited in the admin).
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from llmqueue.models import BulkJob, Tenant


def visible_tenants(user: Any) -> QuerySet[Tenant]:
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(members=user)


def visible_jobs(user: Any) -> QuerySet[BulkJob]:
    """Newest first; another tenant's job is as unknown as a missing one."""
    jobs = BulkJob.objects.select_related("tenant", "tier").order_by("-created_at", "-pk")
    if user.is_staff:
        return jobs
    return jobs.filter(tenant__members=user)
