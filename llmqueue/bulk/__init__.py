"""Bulk jobs: the OpenAI Batch API's files and batches, their lines, pacing and output."""
