"""The /bulk/ upload form: a file, the tenant (among the user's), tier, endpoint, default model."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.db.models import QuerySet

from llmqueue.bulk.lines import ENDPOINTS
from llmqueue.bulk.uploads import Upload
from llmqueue.models import Tenant, Tier


class UploadForm(forms.Form):
    file = forms.FileField(
        help_text="JSONL: the Batch API's lines. CSV (a name ending in .csv): a header row "
        "naming the columns, `prompt` required; see the README."
    )
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), empty_label=None)
    tier = forms.ModelChoiceField(
        queryset=Tier.objects.all(),
        required=False,
        empty_label="bulk default (the flex tier if the tenant may use it, else its default)",
    )
    endpoint = forms.ChoiceField(
        choices=[("", "JSONL: its lines' url; CSV: chat completions")]
        + [(url, url) for url in ENDPOINTS],
        required=False,
    )
    model = forms.CharField(
        max_length=200, required=False, help_text="For the lines that name no model."
    )

    def __init__(self, *args: Any, tenants: QuerySet[Tenant], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["tenant"]
        field.queryset = tenants.filter(is_active=True)
        if field.queryset.count() == 1:  # nothing to choose: the user's one tenant
            field.initial = field.queryset.get()
            field.widget = forms.HiddenInput()

    def clean_file(self) -> Any:
        uploaded = self.cleaned_data["file"]
        if uploaded.size > settings.LLMQUEUE_BULK_MAX_FILE_BYTES:
            raise forms.ValidationError(
                f"Files take at most {settings.LLMQUEUE_BULK_MAX_FILE_BYTES} bytes."
            )
        return uploaded

    def tenant_and_tier(self) -> tuple[int, str | None]:
        tier = self.cleaned_data["tier"]
        return self.cleaned_data["tenant"].pk, tier.name if tier else None

    def upload(self) -> Upload:
        uploaded = self.cleaned_data["file"]
        return Upload(
            filename=uploaded.name or "upload.jsonl",
            data=uploaded.read(),
            endpoint=self.cleaned_data["endpoint"] or None,
            model=self.cleaned_data["model"].strip() or None,
        )
