"""Files of the Files API: stored through Django's storage API, owned by one tenant."""

from __future__ import annotations

from django.core.files.base import ContentFile, File
from django.db import transaction

from llmqueue.api.errors import BadRequest, InvalidParameter, NotFound
from llmqueue.api.validation import is_storable_text
from llmqueue.models import BulkJob, StoredFile

UPLOAD_PURPOSES = frozenset({StoredFile.Purpose.BATCH})
FILENAME_CHARS = StoredFile._meta.get_field("filename").max_length or 255


def store_upload(tenant_id: int, purpose: str, upload: File, filename: str) -> StoredFile:
    """Keep an uploaded file; only `purpose` "batch" is taken (what this API runs)."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidParameter(
            f"'purpose' must be 'batch'; got {purpose!r}.", code="invalid_purpose", param="purpose"
        )
    if len(filename) > FILENAME_CHARS or not is_storable_text(filename):
        raise BadRequest(
            f"The file's name must be text of at most {FILENAME_CHARS} characters, without NUL.",
            param="file",
        )
    stored = StoredFile(tenant_id=tenant_id, purpose=purpose, filename=filename, bytes=upload.size)
    stored.content.save(filename, upload, save=False)
    stored.save()
    return stored


def store_output(tenant_id: int, filename: str, data: bytes) -> StoredFile:
    """Keep a file the queue wrote (a batch's output or errors)."""
    stored = StoredFile(
        tenant_id=tenant_id,
        purpose=StoredFile.Purpose.BATCH_OUTPUT,
        filename=filename,
        bytes=len(data),
    )
    stored.content.save(filename, ContentFile(data), save=False)
    stored.save()
    return stored


def own_file(tenant_id: int, file_id: str) -> StoredFile:
    """The tenant's file `file_id`; another tenant's is as unknown as a missing one (404)."""
    stored = StoredFile.objects.filter(pk=file_id, tenant_id=tenant_id).first()
    if stored is None:
        raise NotFound(f"No file with id {file_id!r}.", code="file_not_found", param="file_id")
    return stored


def read_content(stored: StoredFile) -> bytes:
    with stored.content.open("rb") as handle:
        return bytes(handle.read())


def delete_file(stored: StoredFile) -> None:
    """Delete the file and its bytes. A batch's input stays while its batch exists (its lines
    come from it); outputs may go, the batch then names none."""
    if BulkJob.objects.filter(input_file=stored).exists():
        raise InvalidParameter(
            f"File {stored.id} is the input of a batch; it stays while the batch exists.",
            code="file_in_use",
            param="file_id",
        )
    name = stored.content.name
    storage = stored.content.storage
    with transaction.atomic():
        stored.delete()
    if name:
        storage.delete(name)
